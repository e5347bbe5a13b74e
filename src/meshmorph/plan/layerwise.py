"""The best per-layer strategies of one stage, exact under cost/layerwise_cost.py.

A dynamic program over the stage's layers: after layer i, for every tensor-parallel degree the
layer may use (the state: the next transition depends only on it), the set of partial assignments that no
other one beats on all four of (time so far, additive memory so far, largest working set,
largest ZeRO-3 gather buffer) — a Pareto set, so the memory cap is honoured exactly, not through
a penalty. Extending a label by layer i + 1 under strategy s' with recompute r adds the
transition between their tp's (cost/transition.py) and the layer's own terms (cost/layerwise_cost.py).

Bounds keep the sets small without losing the optimum: a label is dropped when its time plus the
least time the remaining layers can take exceeds ``upper_bound_s`` (a stage time already
achieved, e.g. the best uniform strategy's), or when its memory plus the least memory the
remaining layers need exceeds the device; within one strategy a recompute mode that is no
faster and needs no less memory than another is never tried.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

from meshmorph.cost.layerwise_cost import (
    LayerTerms,
    layer_plan,
    layer_times,
    reserved_bytes,
    terms_on_rank,
)
from meshmorph.cost.model import CostModel
from meshmorph.cost.rank_terms import rank_memory_terms
from meshmorph.cost.transition import transition
from meshmorph.spec.gpus import GPUSpec
from meshmorph.spec.model import Recompute
from meshmorph.spec.plan import LayerStrategy, Plan, PlanError


@dataclass(frozen=True, slots=True)
class StageSolution:
    """The fastest assignment of a stage that fits."""

    strategies: tuple[LayerStrategy, ...]
    """One per layer."""
    recompute: tuple[Recompute, ...]
    """One per layer."""
    busy_s: float
    """m (f + b + transitions) + tail: the stage's step time by itself."""
    memory_bytes: float
    """Peak bytes of one rank."""
    labels: int
    """Pareto labels the program kept in all (its work)."""


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


_Choice = tuple[int, Recompute, float, float, LayerTerms]
TermsCache = dict[tuple, Any]
"""Layer terms already computed, by (layer class, strategy, recompute, stage shape, rank), their
rank-independent times (without the rank), each strategy's layer plan and memory coefficients,
and whole rows of choices: identical blocks, ranks and repeated stage shapes cost one
evaluation."""


def stage_choices(cost: CostModel, plan: Plan, pp_rank: int, start: int, stop: int,
                  strategies: Sequence[LayerStrategy], recompute: Sequence[Recompute],
                  gpu: GPUSpec, cache: TermsCache | None = None,
                  chunks: Sequence[tuple[int, int]] | None = None) -> list[list[_Choice]]:
    """Each layer's (strategy index, recompute, step time, additive memory, terms), recompute
    modes beaten on every figure by another of the same strategy left out; the layers of
    ``chunks`` when given (a rank's interleaved chunks), else [start, stop)."""
    cache = {} if cache is None else cache
    m = plan.num_microbatches
    layers = [i for a, b in (chunks or [(start, stop)]) for i in range(a, b)]
    last = cost.model.num_layers - 1
    # one chunk holding both tied ends holds one matrix (CostModel.chunk_params)
    tied = any(a == 0 and b == last + 1 for a, b in (chunks or [(start, stop)]))
    classes = cost.coster(plan.dtype).classes
    # what a layer's terms depend on besides its class, strategy and recompute: the times on
    # ``shape``, the memory coefficients on the rank too (identical ranks' layers: one time)
    shape = (plan.num_microbatches, plan.dp * plan.micro_batch, plan.schedule, plan.pp,
             plan.vpp, plan.dtype, gpu.name, plan.sequence_parallel)
    ranked = (*shape, pp_rank)
    choices: list[list[_Choice]] = []
    offered = (tuple(strategies), tuple(recompute))
    for index in layers:
        # an end carries the tied all-reduce or the head's loss buffers (layer_times)
        drop = (tied and index == last, index == 0, index == last)
        row_key = ("row", classes[index], drop, ranked, offered)  # identical blocks: one row
        done = cache.get(row_key)
        if done is not None:
            choices.append(done)
            continue
        modes = [r for r in recompute if r in cost.model.layers[index].activation]
        row = cache[row_key] = []
        for si, strategy in enumerate(strategies):
            own = []
            sub = cache.get(("sub", strategy, shape))
            if sub is None:
                sub = cache[("sub", strategy, shape)] = layer_plan(plan, strategy)
            memory = cache.get(("memory", strategy, ranked))
            if memory is None:
                memory = cache[("memory", strategy, ranked)] = rank_memory_terms(
                    cost, sub, pp_rank, gpu)
            for mode in modes:
                key = (classes[index], drop, strategy, mode, ranked)
                t = cache.get(key)
                if t is None:
                    times = cache.get((*key[:4], shape))
                    if times is None:
                        times = cache[(*key[:4], shape)] = layer_times(
                            cost, plan, index, strategy, mode, gpu, drop_tied=drop[0],
                            sub=sub)
                    t = cache[key] = terms_on_rank(times, memory)
                own.append((si, mode, m * (t.fwd_s + t.bwd_s) + t.tail_s,
                            t.param_bytes + t.stored_bytes + t.loss_bytes, t))
            row.extend(c for c in own if not any(  # a recompute mode beaten on every figure
                o is not c and o[2] <= c[2] and o[3] <= c[3]
                and o[4].working_bytes <= c[4].working_bytes and (o[2], o[3]) != (c[2], c[3])
                for o in own))
        choices.append(row)
    return choices


def stage_lower_bound_s(choices: list[list[_Choice]]) -> float:
    """No assignment of the stage is faster: each layer at its fastest, no transition."""
    return sum(min(c[2] for c in row) for row in choices)


def solve_stage(cost: CostModel, plan: Plan, pp_rank: int, start: int, stop: int,
                strategies: Sequence[LayerStrategy], recompute: Sequence[Recompute],
                gpu: GPUSpec, *, upper_bound_s: float = float("inf"),
                cache: TermsCache | None = None,
                memory_cap_bytes: float | None = None,
                chunks: Sequence[tuple[int, int]] | None = None,
                ends: tuple[int, int] | None = None) -> StageSolution | None:
    """The fastest per-layer (strategy, recompute) of layers [start, stop) whose memory fits
    ``gpu`` (or ``memory_cap_bytes``, reserve included), or None when none fits (or none beats
    ``upper_bound_s``). With ``chunks`` (a rank's interleaved chunks, in order) the program
    runs over their layers together, no transition between two chunks. With ``ends`` (tp, zero)
    the model's first and last layer, where the stage holds them, use only strategies of that tp
    and ZeRO stage (a tied embedding and head, spec/runnable.py)."""
    if not strategies:
        raise PlanError("solve_stage needs at least one layer strategy")
    m = plan.num_microbatches
    cap = (gpu.memory_bytes if memory_cap_bytes is None else memory_cap_bytes) \
        - reserved_bytes(cost, gpu)
    choices = stage_choices(cost, plan, pp_rank, start, stop, strategies, recompute, gpu, cache,
                            chunks)
    if ends is not None:
        pinned = {i for i, s in enumerate(strategies) if (s.tp, s.zero) == ends}
        layers = [i for a, b in (chunks or [(start, stop)]) for i in range(a, b)]
        for at, index in enumerate(layers):
            if index in (0, cost.model.num_layers - 1):
                choices[at] = [c for c in choices[at] if c[0] in pinned]
                if not choices[at]:
                    return None
    starts: set[int] = set()  # positions where a chunk starts: nothing to redistribute there
    position = 0
    for a, b in chunks or [(start, stop)]:
        starts.add(position)
        position += b - a
    n = len(choices)
    rest_time = [0.0] * (n + 1)
    rest_mem = [0.0] * (n + 1)
    for i in range(n - 1, -1, -1):
        rest_time[i] = rest_time[i + 1] + min(c[2] for c in choices[i])
        rest_mem[i] = rest_mem[i + 1] + min(c[3] for c in choices[i])
    sequences = plan.dp * plan.micro_batch
    # the next transition depends only on the previous layer's tp (ZeRO moves no activation):
    # the program's state is that tp
    some = {s.tp: s for s in strategies}
    moves: dict[tuple[int, int], float] = {}

    def move(a: int, b: int) -> float:
        if (a, b) not in moves:
            try:
                step = transition(cost, some[a], some[b], sequences, plan.dtype, gpu,
                                  sequence_parallel=plan.sequence_parallel)
                moves[a, b] = m * (step.fwd_s + step.bwd_s)
            except PlanError:  # tp's that do not nest: no such neighbours
                moves[a, b] = float("inf")
        return moves[a, b]

    def extend(lab: _Label | None, base: float, c: _Choice, i: int) -> _Label | None:
        t = c[4]
        time = base + c[2]
        add = (lab[1] if lab else 0.0) + c[3]
        work = max(lab[2] if lab else 0.0, t.working_bytes)
        gather = max(lab[3] if lab else 0.0, t.gather_bytes)
        if time + rest_time[i + 1] > upper_bound_s or add + rest_mem[i + 1] + work + gather > cap:
            return None
        return (time, add, work, gather, lab, (c[0], c[1]))

    total = 0
    layer: dict[int, list[_Label]] = {}
    for c in choices[0]:
        lab = extend(None, 0.0, c, 0)
        if lab is not None:
            layer.setdefault(strategies[c[0]].tp, []).append(lab)
    layer = {tp: _pareto(labs) for tp, labs in layer.items()}
    for i in range(1, n):
        hop = (lambda a, b: 0.0) if i in starts else move
        total += sum(len(labs) for labs in layer.values())
        by_tp: dict[int, list[_Choice]] = {}
        for c in choices[i]:
            by_tp.setdefault(strategies[c[0]].tp, []).append(c)
        nxt: dict[int, list[_Label]] = {}
        ahead_time, ahead_mem = rest_time[i + 1], rest_mem[i + 1]
        for tp, own in by_tp.items():
            incoming = _pareto([(lab[0] + hop(p, tp), lab[1], lab[2], lab[3], lab, None)
                                for p, labs in layer.items() if hop(p, tp) < float("inf")
                                for lab in labs])
            # ``extend`` inlined (the same sums, in the same order)
            figures = [(c[2], c[3], c[4].working_bytes, c[4].gather_bytes, (c[0], c[1]))
                       for c in own]
            out = []
            for lab in incoming:
                base, held, working, gathering, parent = lab[0], lab[1], lab[2], lab[3], lab[4]
                for ct, cm, cw, cg, key in figures:
                    time = base + ct
                    add = held + cm
                    work = cw if cw > working else working
                    gather = cg if cg > gathering else gathering
                    if time + ahead_time > upper_bound_s or \
                            add + ahead_mem + work + gather > cap:
                        continue
                    out.append((time, add, work, gather, parent, key))
            if out:
                nxt[tp] = _pareto(out)
        layer = nxt
        if not layer:
            return None
    finals = [lab for labs in layer.values() for lab in labs if lab[1] + lab[2] + lab[3] <= cap]
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
    return StageSolution(strategies=tuple(strategies[s] for s, _ in picked),
                         recompute=tuple(r for _, r in picked), busy_s=best[0],
                         memory_bytes=best[1] + best[2] + best[3] + reserved_bytes(cost, gpu),
                         labels=total + len(finals))
