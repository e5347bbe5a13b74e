"""The fastest recompute for one pipeline stage that fits its rank's memory.

Among the layers of one kind (identical figures) which ones recompute changes neither time nor
memory, so a stage's choice is how many of them use full and how many selective recompute. For
each count of full-recompute layers the fewest selective ones that fit memory are taken; the
fastest of those is the stage's best. The step time never decreases when a stage's times grow
(``cost.pipeline.simulate`` is max-plus), so the best recompute per stage is the best for the
whole plan. Memory comes from ``CostModel.rank_memory`` and its affine terms
(``cost.rank_terms``); the tail from ``cost.rank_terms.rank_tail_s``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from itertools import accumulate

from meshmorph.cost.layer_cost import PieceCost
from meshmorph.cost.model import CostModel
from meshmorph.cost.rank_terms import (
    RankMemoryTerms,
    in_flight_microbatches,
    rank_memory_terms,
    rank_tail_s,
)
from meshmorph.schedule.table import Schedule
from meshmorph.spec.gpus import GPUSpec
from meshmorph.spec.model import Recompute
from meshmorph.spec.plan import Plan

_ORDER = (Recompute.FULL, Recompute.SELECTIVE, Recompute.NONE)
_EDGE = 1e-9
"""Relative distance from the budget within which the affine memory shortcut defers to
``CostModel.rank_memory`` (the two add the same terms in another order)."""

Build = Callable[[list[tuple[int, int]]], tuple[Recompute, ...]]


@dataclass(frozen=True, slots=True)
class StageChoice:
    """A stage's recompute and what it costs (shared by every stage with the same layers)."""

    recompute: tuple[Recompute, ...]
    """Recompute mode of each layer of the stage."""
    time: PieceCost
    """Per-micro-batch times of the stage with that recompute."""
    tail_s: float
    """Exposed gradient sync + optimizer after the rank's last backward."""


class StageSolver:
    """The best recompute of any stage [start, stop) on any pipeline rank of one configuration."""

    def __init__(self, cost: CostModel, plan: Plan, gpus: Sequence[GPUSpec],
                 modes: Sequence[Recompute]):
        self.cost = cost
        self.plan = plan
        self.gpus = list(gpus)
        self.modes = [m for m in _ORDER if m in modes]
        self.model = cost.model
        self.L = self.model.num_layers
        self.classes = cost.coster(plan).classes
        self.zb = plan.schedule == Schedule.ZERO_BUBBLE
        self._cache: dict[tuple, StageChoice | None] = {}
        self._by_range: dict[tuple[int, int, int], StageChoice | None] = {}
        self._fit_cache: dict[tuple, bool] = {}
        self._terms: dict[int, RankMemoryTerms] = {}
        self._figures: dict[str, _LayerFigures] = {}
        self._fit_by_range: dict[tuple[int, int, int], bool] = {}
        # layers whose recompute is a choice (more than one allowed mode keeps activations)
        self._flexible = [sum(1 for m in self.modes if m in layer.activation) > 1
                          for layer in self.model.layers]
        self.class_prefix = [list(accumulate((int(c == rep) for c in self.classes), initial=0))
                             for rep in sorted(set(self.classes))]

    def stage(self, k: int, start: int, stop: int) -> StageChoice | None:
        """Fastest recompute for layers [start, stop) on pipeline rank k that fits, or None."""
        found = self._by_range.get((k, start, stop), False)
        if found is False:
            found = self._by_range[(k, start, stop)] = self._stage(k, start, stop)
        return found

    def fits(self, k: int, start: int, stop: int) -> bool:
        """Whether some recompute of layers [start, stop) fits pipeline rank k: exactly
        ``stage(k, start, stop) is not None``, without timing the recompute choices."""
        found = self._fit_by_range.get((k, start, stop))
        if found is None:
            known = self._by_range.get((k, start, stop), False)
            if known is not False:
                found = known is not None
            else:
                key = self._key(k, start, stop)
                choice = self._cache.get(key, False)
                if choice is not False:
                    found = choice is not None
                else:
                    found = self._fit_cache.get(key)
                    if found is None:
                        found = self._fit_cache[key] = self._any_fits(k, start, stop)
            self._fit_by_range[(k, start, stop)] = found
        return found

    def _key(self, k: int, start: int, stop: int) -> tuple:
        """What a stage's best recompute depends on: layers of one class are interchangeable,
        so the stage is known by its class counts."""
        in_flight = in_flight_microbatches(self.plan.schedule, self.plan.pp, k,
                                           self.plan.num_microbatches, self.plan.vpp)
        counts = tuple(prefix[stop] - prefix[start] for prefix in self.class_prefix)
        return (self.gpus[k].name, in_flight, start == 0, stop == self.L, counts)

    def _stage(self, k: int, start: int, stop: int) -> StageChoice | None:
        key = self._key(k, start, stop)
        choice = self._cache.get(key, False)
        if choice is False:
            choice = self._cache[key] = self._solve(k, start, stop, self.gpus[k])
        return choice

    def _groups(self, start: int, stop: int) -> list[list[int]]:
        """The stage's flexible layers grouped by class (same class: same time and memory)."""
        groups: dict[int, list[int]] = {}
        flexible, classes = self._flexible, self.classes
        for i in range(start, stop):
            if flexible[i]:
                groups.setdefault(classes[i], []).append(i)
        return list(groups.values())

    def _any_fits(self, k: int, start: int, stop: int) -> bool:
        """Whether ``_assignments`` yields anything (``fits``). For one group the candidates
        are, per count f of full layers, f full and the rest selective; memory is affine in f
        where the set of modes in use stays the same, so each such run of counts is settled
        by its two ends unless one lies within the rounding edge of the budget (then every
        count of the run is tried, as ``_one_group`` does)."""
        gpu = self.gpus[k]
        groups = self._groups(start, stop)
        if len(groups) != 1:
            return self.stage(k, start, stop) is not None
        memory = self._group_memory(k, start, stop, gpu, groups[0], self._builder(start, stop, groups))
        n = len(groups[0])
        full_ok = Recompute.FULL in memory.per
        sel_ok = Recompute.SELECTIVE in memory.per
        points = [(f, n - f if sel_ok else 0) for f in (range(n + 1) if full_ok else range(1))]
        # runs of counts that use the same modes: only the ends of a run can fit first
        runs: list[list[tuple[int, int]]] = []
        for point in points:
            used = (point[0] > 0, point[1] > 0)
            if runs and (runs[-1][0][0] > 0, runs[-1][0][1] > 0) == used:
                runs[-1].append(point)
            else:
                runs.append([point])
        edge = _EDGE * memory.budget
        for run in runs:
            ends = (run[0], run[-1])
            if any(memory.fits(*end) for end in ends):
                return True
            # both ends are over the budget; affine between them: over everywhere unless an end
            # lies within the edge, where rank_memory decides point by point
            near = any(abs(memory.total(*end) - memory.budget) <= edge for end in ends)
            if near and any(memory.fits(*point) for point in run[1:-1]):
                return True
        return False

    def _solve(self, k: int, start: int, stop: int, gpu: GPUSpec) -> StageChoice | None:
        best: StageChoice | None = None
        best_key: tuple[float, float] | None = None  # the chain's forward + backward, then B
        for modes in self._assignments(k, start, stop, gpu, self._groups(start, stop)):
            time = self.cost.chunk_time(self.plan, start, stop, modes, gpu)
            key = (time.fwd_s + (time.bgrad_s if self.zb else time.bwd_s), time.bwd_s)
            if best_key is None or key < best_key:
                best, best_key = StageChoice(modes, time, 0.0), key
        if best is None:
            return None
        return replace(best, tail_s=rank_tail_s(self.cost, self.plan, best.time, gpu))

    def _fits(self, k: int, start: int, stop: int, modes: tuple[Recompute, ...], gpu: GPUSpec) -> bool:
        memory = self.cost.rank_memory(self.plan, k, [(start, stop, modes)], gpu)
        return memory.total <= gpu.memory_bytes

    def _extra_backward(self, index: int, gpu: GPUSpec) -> dict[Recompute, float]:
        """Backward time a layer adds per mode over no recompute."""
        coster = self.cost.coster(self.plan)
        plan = self.plan
        base = coster.layer(index, gpu, plan.micro_batch, plan.tp, plan.sequence_parallel,
                            Recompute.NONE).bwd_s
        return {mode: coster.layer(index, gpu, plan.micro_batch, plan.tp, plan.sequence_parallel,
                                   mode).bwd_s - base if mode in self.model.layers[index].activation
                else float("inf") for mode in (Recompute.FULL, Recompute.SELECTIVE)}

    def _builder(self, start: int, stop: int, groups: list[list[int]]) -> Build:
        """Recompute tuple of the stage from (full, selective) counts per group."""
        base = [Recompute.NONE] * (stop - start)
        layers = self.model.layers

        def build(counts: list[tuple[int, int]]) -> tuple[Recompute, ...]:
            modes = list(base)
            for group, (n_full, n_sel) in zip(groups, counts, strict=True):
                for j, index in enumerate(group):
                    mode = Recompute.FULL if j < n_full else (
                        Recompute.SELECTIVE if j < n_full + n_sel else Recompute.NONE)
                    if mode not in layers[index].activation:
                        mode = Recompute.NONE
                    modes[index - start] = mode
            return tuple(modes)

        return build

    def _assignments(self, k: int, start: int, stop: int, gpu: GPUSpec,
                     groups: list[list[int]]) -> Iterator[tuple[Recompute, ...]]:
        """Recompute tuples worth trying: per group, each count of full layers with the fewest
        selective ones that fit (memory falls as layers move none -> selective -> full)."""
        build = self._builder(start, stop, groups)

        if len(groups) == 1:
            yield from self._one_group(k, start, stop, gpu, groups[0], build)
            return

        def options(group: list[int]) -> list[tuple[int, int]]:
            n = len(group)
            full_ok = Recompute.FULL in self.modes
            sel_ok = Recompute.SELECTIVE in self.modes
            return [(f, s) for f in (range(n + 1) if full_ok else [0])
                    for s in (range(n - f + 1) if sel_ok else [0])]

        def rec(i: int, chosen: list[tuple[int, int]]) -> Iterator[tuple[Recompute, ...]]:
            if i == len(groups):
                modes = build(chosen)
                if self._fits(k, start, stop, modes, gpu):
                    yield modes
                return
            for option in options(groups[i]):
                yield from rec(i + 1, [*chosen, option])

        yield from rec(0, [])

    def _group_memory(self, k: int, start: int, stop: int, gpu: GPUSpec, group: list[int],
                      build: Build) -> _GroupMemory:
        """Memory of a stage with one group of interchangeable layers, by its counts."""
        plan = self.plan
        coster = self.cost.coster(plan)
        per = {mode: coster.layer(group[0], gpu, plan.micro_batch, plan.tp, plan.sequence_parallel,
                                  mode) for mode in self.modes
               if mode in self.model.layers[group[0]].activation}
        terms = self._terms.get(k)
        if terms is None:
            terms = self._terms[k] = rank_memory_terms(self.cost, plan, k, gpu)
        return _GroupMemory(self, k, start, stop, gpu, build, per,
                            self.none_total(terms, start, stop, gpu), terms)

    def none_total(self, terms: RankMemoryTerms, start: int, stop: int, gpu: GPUSpec) -> float:
        """``CostModel.rank_memory`` of layers [start, stop) without recompute, added up by its
        own terms (``RankMemoryTerms.total``) from per-layer figures: the same sums in the same
        order as ``rank_memory`` but for its grouping, so the two differ by rounding alone (the
        fits test defers to ``rank_memory`` within ``_EDGE`` of the budget)."""
        layers = self._layer_figures(gpu)
        params = sum(layers.params[start:stop])
        if start == 0 and stop == self.L:  # CostModel.chunk_params: one tied copy
            params -= self.model.layers[-1].tied_params / self.plan.tp
        # with no recompute no layer rematerialises anything: its working set is zero
        return terms.total(params=params, stored=sum(layers.stored[start:stop]), working=0.0,
                           largest_layer_params=max(layers.params[start:stop]))

    def _layer_figures(self, gpu: GPUSpec) -> _LayerFigures:
        figures = self._figures.get(gpu.name)
        if figures is None:
            plan, cost = self.plan, self.cost
            coster = cost.coster(plan)
            figures = self._figures[gpu.name] = _LayerFigures(
                params=[cost.chunk_params(i, i + 1, plan.tp) for i in range(self.L)],
                stored=[coster.layer(i, gpu, plan.micro_batch, plan.tp, plan.sequence_parallel,
                                     Recompute.NONE).activation_bytes for i in range(self.L)])
        return figures

    def _one_group(self, k: int, start: int, stop: int, gpu: GPUSpec, group: list[int],
                   build: Build) -> Iterator[tuple[Recompute, ...]]:
        """One group of interchangeable layers (the usual case): for each count of full
        recompute, the fewest selective ones that fit. Memory is affine in the counts
        (``cost.rank_terms``), so it is computed from the all-none stage; a full recompute costs
        more time than a selective one, so the loop stops once the full ones alone cost more
        than the best found."""
        memory = self._group_memory(k, start, stop, gpu, group, build)
        per, fits = memory.per, memory.fits
        n = len(group)
        extra = self._extra_backward(group[0], gpu)
        best_extra = float("inf")
        full_counts = range(n + 1) if Recompute.FULL in per else range(1)
        for n_full in full_counts:
            if n_full * extra[Recompute.FULL] >= best_extra:
                break
            sels = range(n - n_full + 1) if Recompute.SELECTIVE in per else range(1)
            lo, hi = 0, len(sels) - 1
            if not fits(n_full, sels[hi]):
                continue
            while lo < hi:  # memory decreases as n_sel grows: binary search
                mid = (lo + hi) // 2
                if fits(n_full, sels[mid]):
                    hi = mid
                else:
                    lo = mid + 1
            best_extra = min(best_extra, n_full * extra[Recompute.FULL]
                             + sels[lo] * extra[Recompute.SELECTIVE])
            yield build([(n_full, sels[lo])])


@dataclass(frozen=True, slots=True)
class _LayerFigures:
    """Per layer, what a rank's memory without recompute adds up (one GPU type)."""

    params: list[float]
    """Parameters on one tensor-parallel rank (``CostModel.chunk_params`` of the layer)."""
    stored: list[float]
    """Activation bytes kept per micro-batch without recompute."""


@dataclass(slots=True)
class _GroupMemory:
    """Peak memory of one stage whose flexible layers form one group, by (full, selective)
    counts: the all-none stage's ``rank_memory`` plus the affine change (``cost.rank_terms``)."""

    solver: StageSolver
    k: int
    start: int
    stop: int
    gpu: GPUSpec
    build: Build
    per: dict[Recompute, PieceCost]
    """The group's per-layer figures for each mode it may use."""
    none_total: float
    """Peak bytes with no layer recomputing."""
    terms: RankMemoryTerms

    @property
    def budget(self) -> float:
        return self.gpu.memory_bytes

    def total(self, n_full: int, n_sel: int) -> float:
        """Affine peak bytes with ``n_full`` full and ``n_sel`` selective layers."""
        per = self.per
        a_none = per[Recompute.NONE].activation_bytes
        saved = 0.0
        work = 0.0
        for mode, count in ((Recompute.FULL, n_full), (Recompute.SELECTIVE, n_sel)):
            if count:
                saved += count * (a_none - per[mode].activation_bytes)
                work = max(work, per[mode].working_bytes)
        return self.none_total + self.terms.activation_bytes(-saved, work)

    def fits(self, n_full: int, n_sel: int) -> bool:
        budget = self.gpu.memory_bytes
        total = self.total(n_full, n_sel)
        if abs(total - budget) > _EDGE * budget:
            return total < budget
        # at the edge the affine shortcut may round the other way: trust rank_memory
        return self.solver._fits(self.k, self.start, self.stop, self.build([(n_full, n_sel)]),
                                 self.gpu)
