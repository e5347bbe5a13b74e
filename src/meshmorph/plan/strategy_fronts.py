"""Pareto fronts of one pipeline stage's per-layer assignments, for the exact pp > 1 search.

With pp > 1 the step is the schedule simulated over every stage's per-micro-batch forward and
backward times (zero-bubble: input and weight gradient apart), each rank's end plus its tail
(``CostModel.estimate``, each layer its own segment). The simulator is max-plus, so the step never decreases when one of
those figures grows: of the assignments of a stage that fit its rank's memory, only those that no
other beats on every one of (f, b, [w,] tail) can be part of an optimum — the stage's front.

The front of every stage [start, stop) of rank k comes from one dynamic program over layers, run
from ``start`` to the right (all stops at once), or for the last rank from the model's end to
the left (all starts at once). Its state is the tp of the layer at the open end (the next
transition depends only on it, cost/transition.py); its labels the Pareto set of (f, b, w, tail,
additive memory, largest working set, largest gather buffer), so the memory cap is met exactly.
A label is dropped when its memory already exceeds the device or when a lower bound on every
step it can be part of (``label_bound``) reaches ``cut``, the best step already found.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

from meshmorph.cost.layer_cost import PieceCost
from meshmorph.cost.model import CostModel
from meshmorph.cost.rank_terms import device_reserve_bytes
from meshmorph.plan.strategy_dp import Choice, Moves, TermsCache, pin_ends, stage_choices
from meshmorph.schedule.table import Schedule
from meshmorph.spec.gpus import GPUSpec
from meshmorph.spec.model import Recompute
from meshmorph.spec.plan import LayerStrategy, Plan, PlanError

# a label: f, b, w, tail, additive memory, working set, gather buffer, parent, (layer, choice)
_Label = tuple


@dataclass(frozen=True, slots=True)
class FrontPoint:
    """One assignment of a stage on the front."""

    fwd_s: float
    """Forward per micro-batch, transitions included."""
    bwd_s: float
    """Backward per micro-batch (zero-bubble: the input gradient only), transitions included."""
    wgrad_s: float
    """Weight gradient per micro-batch under zero-bubble, else 0."""
    tail_s: float
    """The stage's layers' tails (gradient sync, parameter gathers, optimizer step)."""
    memory_bytes: float
    """Peak bytes of one rank, reserve included."""
    node: _Label
    """The program's label, from which the assignment is read back."""

    def busy_s(self, m: int) -> float:
        """The stage's own step time: m (f + b + w) + tail."""
        return m * (self.fwd_s + self.bwd_s + self.wgrad_s) + self.tail_s

    def assignment(self, strategies: Sequence[LayerStrategy]
                   ) -> list[tuple[int, LayerStrategy, Recompute]]:
        """(layer, strategy, recompute) of each layer, in layer order."""
        out = []
        node = self.node
        while node is not None:
            index, si, mode = node[8]
            out.append((index, strategies[si], mode))
            node = node[7]
        return sorted(out, key=lambda x: x[0])


def pareto(labels: list[_Label], dims: int = 7) -> list[_Label]:
    """Labels no other beats or equals on the first ``dims`` figures (7: every figure of a label,
    4: the times only). Sorted by the figures, a label can only be beaten by one kept before it."""
    labels.sort(key=lambda x: x[:dims])
    kept: list[_Label] = []
    if dims == 4:
        for x in labels:
            for y in kept:
                if y[1] <= x[1] and y[2] <= x[2] and y[3] <= x[3] and y[0] <= x[0]:
                    break
            else:
                kept.append(x)
        return kept
    for x in labels:
        for y in kept:
            if (y[1] <= x[1] and y[4] <= x[4] and y[3] <= x[3] and y[2] <= x[2] and y[0] <= x[0]
                    and y[5] <= x[5] and y[6] <= x[6]):
                break
        else:
            kept.append(x)
    return kept


class FrontBudgetExceeded(PlanError):
    """A stage's program kept more labels than its budget (the search then reports the
    configuration's bound as unproven instead of running on)."""


class StageFronts:
    """The fronts of every stage of one pipeline configuration (pp > 1, one chunk per rank)."""

    def __init__(self, cost: CostModel, plan: Plan, strategies: Sequence[LayerStrategy],
                 recompute: Sequence[Recompute], gpu: GPUSpec, cache: TermsCache, *,
                 uniform: bool = False, max_labels: int | None = None,
                 ends: tuple[int, int] | None = None):
        if plan.pp < 2 or plan.vpp != 1:
            raise PlanError("stage fronts are for pp > 1 with one chunk per rank")
        self.cost, self.plan, self.gpu = cost, plan, gpu
        self.strategies = list(strategies)
        self.recompute = tuple(recompute)
        self.cache = cache
        self.uniform = uniform
        self.ends = ends
        """(tp, zero) the model's first and last layer are held to (a tied embedding and head),
        or None."""
        self.p, self.m, self.L = plan.pp, plan.num_microbatches, cost.model.num_layers
        self.zb = plan.schedule == Schedule.ZERO_BUBBLE
        self.reserve = device_reserve_bytes(cost, gpu)
        self.cap = gpu.memory_bytes - self.reserve
        self._rows: dict[int, list[list[Choice]]] = {}
        self._fronts: dict[tuple[int, int], tuple[float, dict[int, list[FrontPoint]]]] = {}
        self.move = Moves(cost, plan, strategies, gpu)
        """(forward, backward) seconds per micro-batch from a layer at one tp to one at another."""
        rows = self.rows(0)
        # the least figures of each layer, whatever its strategy (the bounds read them)
        self.least_f = [min(c.piece.fwd_s for c in row) for row in rows]
        self.least_b = [min(self._b(c.piece) for c in row) for row in rows]
        self.least_w = [min(self._w(c.piece) for c in row) for row in rows]
        self.least_busy = [min(c.busy_s for c in row) for row in rows]
        self.least_tail = [min(c.tail_s for c in row) for row in rows]
        self.prefix_f, self.prefix_b, self.prefix_busy = (
            list(accumulate(values, initial=0.0))
            for values in (self.least_f, self.least_b, self.least_busy))
        # the last rank holding [a, L) waits prefix_f[a] and runs the layers [a, pos) before a
        # label that starts at pos: at least the least of that over its possible starts
        self.lead = [min((self.prefix_f[a] + self.prefix_busy[pos] - self.prefix_busy[a]
                          for a in range(self.p - 1, pos + 1)), default=0.0)
                     for pos in range(self.L + 1)]
        self.max_labels = max_labels

    def _b(self, t: PieceCost) -> float:
        return t.bwd_s - t.wgrad_s if self.zb else t.bwd_s

    def _w(self, t: PieceCost) -> float:
        return t.wgrad_s if self.zb else 0.0

    def rows(self, k: int) -> list[list[Choice]]:
        """Each layer's choices on rank k (no rank of pp > 1 holds both tied ends; with ``ends``
        the first and last layer's only under that (tp, zero)), less those
        another choice at the same tp (so the same transitions) beats or equals on every
        figure: forward, backward, weight gradient, tail and the three memory terms (under
        pipeline parallelism ZeRO-3 holds what ZeRO-2 holds and gathers more, for one)."""
        if k not in self._rows:
            plan, L = self.plan, self.L
            every = [*stage_choices(self.cost, plan, k, 0, L - 1, self.strategies,
                                    self.recompute, self.gpu, self.cache),
                     *stage_choices(self.cost, plan, k, L - 1, L, self.strategies,
                                    self.recompute, self.gpu, self.cache)]
            if self.ends is not None:  # before pruning: a choice at another ZeRO stage may
                # be what beats the allowed ones
                pin_ends(every, range(L), self.strategies, self.ends, L)
            self._rows[k] = [self._undominated(row) for row in every]
        return self._rows[k]

    def _undominated(self, row: list[Choice]) -> list[Choice]:
        """``_pruned`` of one row, once per row (identical blocks share one row object, which
        the terms cache keeps alive) and zero-bubble setting."""
        key = ("undominated", id(row), self.zb)
        done = self.cache.get(key)
        if done is None or done[0] is not row:
            done = self.cache[key] = (row, self._pruned(row))
        return done[1]

    def _pruned(self, row: list[Choice]) -> list[Choice]:
        def figures(c: Choice) -> tuple:
            t = c.piece
            return (self.strategies[c.strategy].tp, t.fwd_s, self._b(t), self._w(t), c.tail_s,
                    c.memory_bytes, t.working_bytes, c.gather_bytes)

        keyed = sorted(((figures(c), i, c) for i, c in enumerate(row)), key=lambda x: (x[0], x[1]))
        kept: list[tuple] = []
        for fig, _, c in keyed:
            if any(o[0] == fig[0] and all(a <= b for a, b in zip(o[1:], fig[1:], strict=True))
                   for o, _ in kept):
                continue
            kept.append((fig, c))
        return [c for _, c in kept]

    def label_bound(self, start: int, f: float, b: float, w: float, tail: float) -> float:
        """No step of a plan whose rank holding layers from ``start`` has at least these figures
        is shorter: micro-batch 0 reaches the rank after the forwards of the layers before it,
        the rank runs m forwards and backwards, then its tail beside the backward chain back to
        rank 0 (zero-bubble: its W ops may follow its last B)."""
        pf, pb, m = self.prefix_f[start], self.prefix_b[start], self.m
        if self.zb:
            return max(pf + m * (f + b + w) + tail, pf + m * (f + b) + pb)
        return pf + m * (f + b) + max(tail, pb)

    def _spread_bound(self, k: int, start: int, index: int, reverse: bool, lab: _Label) -> float:
        """A bound that also places the layers outside the label. Forward (the label holds
        [start, index]): the rank runs x more of the least busy time R of the layers after, the
        left later ranks share R - x after the forward chain reaches them, so the step is at least
        min_x max(A + x, C - x / left) with A = its start's forward chain + its busy time and
        C = A's chain + the label's forward + R / left. Backward (last rank, [index, L)): the
        least over its starts a of the chain to a plus the layers [a, index), plus its busy."""
        m = self.m
        busy = m * (lab[0] + lab[1] + lab[2]) + lab[3]
        if reverse:
            return self.lead[index] + busy
        left = self.p - 1 - k
        if left == 0:
            return self.prefix_f[start] + busy
        a = self.prefix_f[start] + busy
        c = self.prefix_f[start] + lab[0] + (self.prefix_busy[self.L]
                                             - self.prefix_busy[index + 1]) / left
        return a + max(0.0, (c - a) * left / (left + 1))

    def front(self, k: int, start: int, stop: int, cut: float) -> list[FrontPoint]:
        """The front of layers [start, stop) on rank k (points whose bound reaches ``cut`` may be
        left out), sorted by busy time."""
        last = k == self.p - 1
        key = (k, -1 if last else start)
        done = self._fronts.get(key)
        if done is None or done[0] < cut:  # a program run under a looser cut serves this one
            done = self._fronts[key] = (cut, self._run(k, start, cut, reverse=last))
        fronts = done[1]
        return [pt for pt in fronts.get(start if last else stop, [])
                if self.label_bound(start, pt.fwd_s, pt.bwd_s, pt.wgrad_s, pt.tail_s) < cut]

    def _run(self, k: int, start: int, cut: float, *, reverse: bool) -> dict[int, list[FrontPoint]]:
        if not self.uniform:
            return self._program(k, start, cut, list(range(len(self.strategies))), reverse)
        merged: dict[int, list[FrontPoint]] = {}
        for si in range(len(self.strategies)):
            for at, points in self._program(k, start, cut, [si], reverse).items():
                merged.setdefault(at, []).extend(points)
        return {at: self._front_of([pt.node for pt in points]) for at, points in merged.items()}

    def _front_of(self, labels: list[_Label]) -> list[FrontPoint]:
        reserve = self.reserve
        points = [FrontPoint(x[0], x[1], x[2], x[3], x[4] + x[5] + x[6] + reserve, x)
                  for x in pareto(list(labels), dims=4)]
        return sorted(points, key=lambda pt: pt.busy_s(self.m))

    def _program(self, k: int, start: int, cut: float, allowed: list[int],
                 reverse: bool) -> dict[int, list[FrontPoint]]:
        """Forward from ``start`` (fronts by stop), or for the last rank backward from the
        model's end (fronts by start; the bound then uses the earliest start, rank k's k)."""
        rows = self.rows(k)
        allowed_set = set(allowed)
        order = list(range(self.L - 1, k - 1, -1)) if reverse else list(
            range(start, self.L - (self.p - 1 - k)))
        bound_start = k if reverse else start
        strategies, cap = self.strategies, self.cap
        fronts: dict[int, list[FrontPoint]] = {}
        layer: dict[int, list[_Label]] = {}
        for pos, index in enumerate(order):
            choices = [c for c in rows[index] if c.strategy in allowed_set]
            nxt: dict[int, list[_Label]] = {}
            for c in choices:
                t, tp = c.piece, strategies[c.strategy].tp
                cf, cb, cw = t.fwd_s, self._b(t), self._w(t)
                sources = layer.items() if pos else [(tp, [None])]
                for other, labs in sources:
                    mf, mb = (0.0, 0.0) if not pos else (
                        self.move(tp, other) if reverse else self.move(other, tp))
                    if mf == float("inf"):
                        continue
                    out = nxt.setdefault(tp, [])
                    for lab in labs:
                        base = (0.0,) * 7 if lab is None else lab
                        new = (base[0] + mf + cf, base[1] + mb + cb, base[2] + cw,
                               base[3] + c.tail_s, base[4] + c.memory_bytes,
                               max(base[5], t.working_bytes), max(base[6], c.gather_bytes), lab,
                               (index, c.strategy, c.mode))
                        if new[4] + new[5] + new[6] > cap:
                            continue
                        if self.label_bound(bound_start, new[0], new[1], new[2], new[3]) >= cut:
                            continue
                        if self._spread_bound(k, start, index, reverse, new) >= cut:
                            continue
                        out.append(new)
            layer = {tp: pareto(labs) for tp, labs in nxt.items() if labs}
            kept = sum(len(labs) for labs in layer.values())
            if self.max_labels is not None and kept > self.max_labels:
                raise FrontBudgetExceeded(f"{kept} labels after layer {index} on rank {k}")
            if not layer:
                break
            fronts[index if reverse else index + 1] = self._front_of(
                [lab for labs in layer.values() for lab in labs])
        return fronts
