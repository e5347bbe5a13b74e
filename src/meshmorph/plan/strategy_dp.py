"""The fastest per-layer strategies of one pipeline rank: a dynamic program over its layers.

Each layer may run under any offered strategy (tp, dp, ZeRO) and recompute mode, priced as its
own segment by the cost model (``CostModel.layer_alone``, cost/segments.py), with the
redistribution between neighbours of different tp (cost/transition.py) and its bytes from
``rank_memory_terms`` (cost/rank_terms.py): the same figures ``CostModel.estimate`` adds up.

After layer i, for every tp the layer may use (the state: the next transition depends only on
it), the program keeps the partial assignments no other beats on all four of (time so far,
additive memory so far, largest working set, largest ZeRO-3 gather buffer): a Pareto set, so
the memory cap is met exactly, not through a penalty. A label is dropped when its time plus the
least time the remaining layers can take exceeds ``upper_bound_s`` (a time already achieved), or
when its memory plus the least the remaining layers need exceeds the device; within one
strategy a recompute mode no faster and needing no less memory than another is never tried.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from operator import itemgetter
from typing import Any, NamedTuple

from meshmorph.cost.layer_cost import PieceCost
from meshmorph.cost.model import CostModel
from meshmorph.cost.rank_terms import device_reserve_bytes, head_loss_bytes, rank_memory_terms
from meshmorph.cost.segments import layer_plan
from meshmorph.cost.transition import transition
from meshmorph.spec.gpus import GPUSpec
from meshmorph.spec.model import Recompute
from meshmorph.spec.plan import LayerStrategy, Plan, PlanError


class Choice(NamedTuple):
    """One layer under one strategy and recompute mode, on one rank."""

    strategy: int
    """Index into the offered strategies."""
    mode: Recompute
    """Recompute mode."""
    busy_s: float
    """m (forward + backward) + its tail: what it adds to the rank's own step time."""
    memory_bytes: float
    """Bytes it adds to the rank's peak: its parameters' state, its activations in flight and
    (the head) the loss buffers."""
    piece: PieceCost
    """Its per-micro-batch figures (``CostModel.layer_alone``)."""
    tail_s: float
    """Its gradient sync, parameter gathers and optimizer step per step (at an end of a pipeline
    split between ranks, the tied embedding's all-reduce too)."""
    gather_bytes: float
    """ZeRO-3 gather buffers (the layer plus a prefetch) while it runs."""


@dataclass(frozen=True, slots=True)
class StageSolution:
    """The fastest assignment of a rank's layers that fits."""

    strategies: tuple[LayerStrategy, ...]
    """One per layer."""
    recompute: tuple[Recompute, ...]
    """One per layer."""
    busy_s: float
    """m (f + b + transitions) + tail: the rank's step time by itself."""
    memory_bytes: float
    """Peak bytes of one rank."""
    labels: int
    """Pareto labels the program kept in all (its work)."""


TermsCache = dict[tuple, Any]
"""Layer figures already computed, by (layer class, strategy, recompute, stage shape, rank),
each strategy's layer plan and memory coefficients, and whole rows of choices: identical blocks,
ranks and repeated stage shapes cost one evaluation."""

# a label: (time, additive memory, largest working set, largest gather buffer, parent, choice)
_Label = tuple[float, float, float, float, "tuple | None", "tuple[int, Recompute] | None"]
_TIME_MEMORY = itemgetter(0, 1)


def _front(labels: list[_Label]) -> list[_Label]:
    """2-D Pareto front on (time, memory): sorted by time, memory strictly falling."""
    labels.sort(key=_TIME_MEMORY)
    kept: list[_Label] = []
    for lab in labels:
        if not kept or lab[1] < kept[-1][1]:
            kept.append(lab)
    return kept


def _pareto(labels: list[_Label]) -> list[_Label]:
    """The labels no other beats (or equals) on time, memory, working set and gather buffer:
    a 2-D front per (working set, gather buffer) pair (few distinct values), then each label
    checked against the fronts of the pairs no larger than its own (bisect on time)."""
    groups: dict[tuple[float, float], list[_Label]] = {}
    for lab in labels:
        groups.setdefault((lab[2], lab[3]), []).append(lab)
    fronts = {key: _front(group) for key, group in groups.items()}
    if len(fronts) == 1:
        return next(iter(fronts.values()))
    times = {key: [lab[0] for lab in front] for key, front in fronts.items()}
    kept: list[_Label] = []
    for key, front in fronts.items():
        smaller = [k for k in fronts if k != key and k[0] <= key[0] and k[1] <= key[1]]
        for lab in front:
            beaten = False
            for k in smaller:
                at = bisect_right(times[k], lab[0]) - 1  # the least memory among time <= lab's
                if at >= 0 and fronts[k][at][1] <= lab[1]:
                    beaten = True
                    break
            if not beaten:
                kept.append(lab)
    return kept


def stage_choices(cost: CostModel, plan: Plan, pp_rank: int, start: int, stop: int,
                  strategies: Sequence[LayerStrategy], recompute: Sequence[Recompute],
                  gpu: GPUSpec, cache: TermsCache | None = None,
                  chunks: Sequence[tuple[int, int]] | None = None) -> list[list[Choice]]:
    """Each layer's choices, recompute modes beaten on every figure by another of the same
    strategy left out; the layers of ``chunks`` when given (a rank's chunks), else
    [start, stop)."""
    cache = {} if cache is None else cache
    spans = chunks or [(start, stop)]
    last = cost.model.num_layers - 1
    # one chunk holding both tied ends holds one matrix (cost/segments.py's drop_tied)
    tied = cost.model.tied_embeddings and any(a == 0 and b == last + 1 for a, b in spans)
    classes = cost.coster(plan).classes
    # what a layer's figures depend on besides its class, strategy and recompute: the times on
    # ``shape``, the memory on the rank too (identical ranks' layers: one time)
    shape = (plan.num_microbatches, plan.dp * plan.micro_batch, plan.schedule, plan.pp,
             plan.vpp, plan.dtype, plan.fp8_scaling, gpu.name, plan.sequence_parallel)
    ranked = (*shape, pp_rank)
    offered = (tuple(strategies), tuple(recompute))
    out = []
    for index in (i for a, b in spans for i in range(a, b)):
        # an end carries the tied all-reduce or the head's loss buffers (layer_alone)
        drop = (tied and index == last, index == 0, index == last)
        row_key = ("row", classes[index], drop, ranked, offered)  # identical blocks: one row
        row = cache.get(row_key)
        if row is None:
            row = cache[row_key] = _row(cost, plan, pp_rank, index, strategies, recompute, gpu,
                                        cache, (classes[index], drop, shape, ranked))
        out.append(row)
    return out


def _row(cost: CostModel, plan: Plan, pp_rank: int, index: int,
         strategies: Sequence[LayerStrategy], recompute: Sequence[Recompute], gpu: GPUSpec,
         cache: TermsCache, keys: tuple) -> list[Choice]:
    """One layer's choices (``stage_choices``); ``keys``: its class, end flags, shape, rank."""
    klass, drop, shape, ranked = keys
    m = plan.num_microbatches
    modes = [r for r in recompute if r in cost.model.layers[index].activation]
    row = []
    for si, strategy in enumerate(strategies):
        sub = cache.get(("sub", strategy, shape))
        if sub is None:
            sub = cache[("sub", strategy, shape)] = layer_plan(plan, strategy)
        memory = cache.get(("memory", strategy, ranked))
        if memory is None:
            memory = cache[("memory", strategy, ranked)] = rank_memory_terms(cost, sub, pp_rank,
                                                                             gpu)
        loss = head_loss_bytes(cost, sub, pp_rank) if drop[2] else 0.0
        own = []
        for mode in modes:
            key = (klass, drop, strategy, mode, shape)
            priced = cache.get(key)
            if priced is None:
                priced = cache[key] = cost.layer_alone(sub, index, mode, gpu, drop_tied=drop[0])
            piece, tail = priced
            own.append(Choice(si, mode, m * (piece.fwd_s + piece.bwd_s) + tail,
                              piece.params * memory.bytes_per_param
                              + piece.activation_bytes * memory.in_flight + loss,
                              piece, tail, piece.params * memory.gather_bytes_per_param))
        row.extend(c for c in own if not any(  # a recompute mode beaten on every figure
            o is not c and o.busy_s <= c.busy_s and o.memory_bytes <= c.memory_bytes
            and o.piece.working_bytes <= c.piece.working_bytes
            and (o.busy_s, o.memory_bytes) != (c.busy_s, c.memory_bytes) for o in own))
    return row


def pin_ends(rows: list[list[Choice]], layers: Sequence[int], strategies: Sequence[LayerStrategy],
             ends: tuple[int, int], num_layers: int) -> bool:
    """Keep only choices under (tp, zero) ``ends`` for the model's first and last layer among
    ``layers`` (a tied embedding and head, spec/runnable.py); False when one has none left."""
    for at, index in enumerate(layers):
        if index in (0, num_layers - 1):
            rows[at] = [c for c in rows[at]
                        if (strategies[c.strategy].tp, strategies[c.strategy].zero) == ends]
            if not rows[at]:
                return False
    return True


class Moves:
    """(forward, backward) seconds per micro-batch between neighbouring layers of tp ``a`` and
    ``b`` on one stage (cost/transition.py), memoised; infinite for tp's that do not nest."""

    def __init__(self, cost: CostModel, plan: Plan, strategies: Sequence[LayerStrategy],
                 gpu: GPUSpec):
        self.cost, self.plan, self.gpu = cost, plan, gpu
        self.by_tp = {s.tp: s for s in strategies}
        self._moves: dict[tuple[int, int], tuple[float, float]] = {}

    def __call__(self, a: int, b: int) -> tuple[float, float]:
        found = self._moves.get((a, b))
        if found is None:
            plan = self.plan
            try:
                step = transition(self.cost, self.by_tp[a], self.by_tp[b],
                                  plan.dp * plan.micro_batch, plan.dtype, self.gpu,
                                  sequence_parallel=plan.sequence_parallel)
                found = (step.fwd_s, step.bwd_s)
            except PlanError:  # tp's that do not nest cannot be neighbours
                found = (float("inf"), float("inf"))
            self._moves[a, b] = found
        return found


def stage_lower_bound_s(choices: list[list[Choice]]) -> float:
    """No assignment of the stage is faster: each layer at its fastest, no transition."""
    return sum(min(c.busy_s for c in row) for row in choices)


def solve_stage(cost: CostModel, plan: Plan, pp_rank: int, start: int, stop: int,
                strategies: Sequence[LayerStrategy], recompute: Sequence[Recompute],
                gpu: GPUSpec, *, upper_bound_s: float = float("inf"),
                cache: TermsCache | None = None,
                memory_cap_bytes: float | None = None,
                chunks: Sequence[tuple[int, int]] | None = None,
                ends: tuple[int, int] | None = None) -> StageSolution | None:
    """The fastest per-layer (strategy, recompute) of layers [start, stop) whose memory fits
    ``gpu`` (or ``memory_cap_bytes``, reserve included), or None when none fits (or none beats
    ``upper_bound_s``). With ``chunks`` (a rank's chunks, in order) the program runs over their
    layers together, no transition between two chunks. With ``ends`` (tp, zero) the model's
    first and last layer, where the stage holds them, use only strategies of that tp and ZeRO
    stage (a tied embedding and head, spec/runnable.py)."""
    if not strategies:
        raise PlanError("solve_stage needs at least one layer strategy")
    spans = chunks or [(start, stop)]
    reserve = device_reserve_bytes(cost, gpu)
    cap = (gpu.memory_bytes if memory_cap_bytes is None else memory_cap_bytes) - reserve
    choices = stage_choices(cost, plan, pp_rank, start, stop, strategies, recompute, gpu, cache,
                            chunks)
    if ends is not None and not pin_ends(choices, [i for a, b in spans for i in range(a, b)],
                                         strategies, ends, cost.model.num_layers):
        return None
    # positions where a chunk starts: nothing to redistribute there
    starts = set(accumulate((b - a for a, b in spans[:-1]), initial=0))
    program = _Program(choices, strategies, cap, upper_bound_s, plan.num_microbatches,
                       Moves(cost, plan, strategies, gpu))
    found = program.run(starts)
    if found is None:
        return None
    best, picked = found
    return StageSolution(strategies=tuple(strategies[s] for s, _ in picked),
                         recompute=tuple(r for _, r in picked), busy_s=best[0],
                         memory_bytes=best[1] + best[2] + best[3] + reserve,
                         labels=program.labels)


class _Program:
    """``solve_stage``'s dynamic program over one rank's layers (module docstring)."""

    def __init__(self, choices: list[list[Choice]], strategies: Sequence[LayerStrategy],
                 cap: float, upper_bound_s: float, m: int, moves: Moves):
        self.choices, self.strategies, self.cap, self.bound = choices, strategies, cap, \
            upper_bound_s
        self.m, self.moves = m, moves
        n = len(choices)
        self.rest_time = [0.0] * (n + 1)
        self.rest_mem = [0.0] * (n + 1)
        for i in range(n - 1, -1, -1):
            self.rest_time[i] = self.rest_time[i + 1] + min(c.busy_s for c in choices[i])
            self.rest_mem[i] = self.rest_mem[i + 1] + min(c.memory_bytes for c in choices[i])
        self.labels = 0

    def hop(self, a: int, b: int) -> float:
        """Seconds per step a transition from tp ``a`` to ``b`` adds (m of them)."""
        f, b_ = self.moves(a, b)
        return self.m * (f + b_)

    def run(self, starts: set[int]) -> tuple[_Label, list[tuple[int, Recompute]]] | None:
        """(the fastest final label that fits, its (strategy, recompute) per layer), or None."""
        layer: dict[int, list[_Label]] = {}
        for c in self.choices[0]:
            lab = self._extend(None, c, 0)
            if lab is not None:
                layer.setdefault(self.strategies[c.strategy].tp, []).append(lab)
        layer = {tp: _pareto(labs) for tp, labs in layer.items()}
        for i in range(1, len(self.choices)):
            self.labels += sum(len(labs) for labs in layer.values())
            layer = self._step(layer, i, i in starts)
            if not layer:
                return None
        cap = self.cap
        finals = [lab for labs in layer.values() for lab in labs if lab[1] + lab[2] + lab[3] <= cap]
        self.labels += len(finals)
        if not finals:
            return None
        best = min(finals, key=lambda x: x[0])
        picked: list[tuple[int, Recompute]] = []
        node: _Label | None = best
        while node is not None:
            assert node[5] is not None
            picked.append(node[5])
            node = node[4]
        picked.reverse()
        return best, picked

    def _extend(self, lab: _Label | None, c: Choice, i: int) -> _Label | None:
        time = (lab[0] if lab else 0.0) + c.busy_s
        add = (lab[1] if lab else 0.0) + c.memory_bytes
        work = max(lab[2] if lab else 0.0, c.piece.working_bytes)
        gather = max(lab[3] if lab else 0.0, c.gather_bytes)
        if time + self.rest_time[i + 1] > self.bound or \
                add + self.rest_mem[i + 1] + work + gather > self.cap:
            return None
        return (time, add, work, gather, lab, (c.strategy, c.mode))

    def _step(self, layer: dict[int, list[_Label]], i: int,
              chunk_start: bool) -> dict[int, list[_Label]]:
        """The labels after layer ``i`` from those after layer ``i - 1`` (no transition where a
        chunk starts)."""
        by_tp: dict[int, list[Choice]] = {}
        for c in self.choices[i]:
            by_tp.setdefault(self.strategies[c.strategy].tp, []).append(c)
        nxt: dict[int, list[_Label]] = {}
        ahead_time, ahead_mem = self.rest_time[i + 1], self.rest_mem[i + 1]
        bound, cap = self.bound, self.cap
        for tp, own in by_tp.items():
            hops = {p: 0.0 if chunk_start else self.hop(p, tp) for p in layer}
            incoming = _pareto([(lab[0] + hops[p], lab[1], lab[2], lab[3], lab, None)
                                for p, labs in layer.items() if hops[p] < float("inf")
                                for lab in labs])
            # ``_extend`` inlined (the same sums, in the same order)
            figures = [(c.busy_s, c.memory_bytes, c.piece.working_bytes, c.gather_bytes,
                        (c.strategy, c.mode)) for c in own]
            out = []
            for lab in incoming:
                base, held, working, gathering, parent = lab[0], lab[1], lab[2], lab[3], lab[4]
                for ct, cm, cw, cg, key in figures:
                    time = base + ct
                    add = held + cm
                    work = cw if cw > working else working
                    gather = cg if cg > gathering else gathering
                    if time + ahead_time > bound or add + ahead_mem + work + gather > cap:
                        continue
                    out.append((time, add, work, gather, parent, key))
            if out:
                nxt[tp] = _pareto(out)
        return nxt
