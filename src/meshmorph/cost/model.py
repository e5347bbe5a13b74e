"""CostModel: a Plan in, an Estimate out (time by simulating the schedule, memory per stage).

Every chunk is priced as its segments (cost/segments.py): one segment under the plan for a
stage without layer strategies, one per layer under the layer's own tp/dp/ZeRO for a stage that
lists them, with the redistribution between layers of different tp (cost/transition.py). The
same ``estimate``, ``rank_memory`` and step tail serve both.

Rank placement follows the Plan: tensor parallel innermost (inside a node), then context
parallel, then data parallel, then pipeline. A collective runs over NVLink/PCIe while its group
fits in a node, otherwise at the inter-node NIC's speed. Parameters are replicated over dp x cp
(``Plan.grad_replicas``): gradient reductions and ZeRO sharding span that group.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from itertools import accumulate
from typing import NamedTuple

from meshmorph.cost import comm
from meshmorph.cost.coefficients import CostCoefficients
from meshmorph.cost.estimate import Estimate, StageMemory
from meshmorph.cost.layer_cost import LayerCoster, PieceCost
from meshmorph.cost.pipeline import (
    Drain,
    Timeline,
    async_steady_step,
    known_drain,
    known_warmup,
    simulate,
)
from meshmorph.cost.profile import Profile
from meshmorph.cost.rank_terms import rank_memory_terms, tail_overlap_window_s
from meshmorph.cost.segments import LayerPlan, Segment, autocast_stream, chunk_segments, fsdp_units
from meshmorph.cost.state import (
    DataParallelTraffic,
    HeldBytes,
    compute_bytes,
    data_parallel_traffic,
    fsdp_shards,
    held_bytes_per_param,
)
from meshmorph.cost.transition import activation_bytes, transition
from meshmorph.schedule.table import Schedule
from meshmorph.spec.cluster import Cluster
from meshmorph.spec.gpus import GPUSpec, LinkSpec, flops_dtype
from meshmorph.spec.model import ModelSpec, Recompute
from meshmorph.spec.plan import Plan, PlanError, StagePlan
from meshmorph.spec.runnable import lists_layer_strategies

Parts = list[list[tuple[Segment, PieceCost]]]
"""Per model chunk, its segments with their priced figures."""


class SyncPart(NamedTuple):
    """One data-parallel collective after a rank's last backward (``CostModel.sync_parts``)."""

    seconds: float
    """Its time alone."""
    share: float
    """The share of it that may hide behind compute (0: none)."""
    window: float
    """The fraction of the last backward's compute it may hide behind."""
    nbytes: float
    """The bytes it moves (its first or last bucket's share never hides)."""


def steady_state(fwd_s: Sequence[float], bwd_s: Sequence[float], m: int) -> Timeline:
    """Asynchronous 1F1B (no flush) priced in its steady state: the slowest stage paces every
    micro-batch, ``m * max_k (f_k + b_k)`` per step on every rank, no fill or drain bubble
    (transfers overlap compute in the steady state)."""
    period = max(f + b for f, b in zip(fwd_s, bwd_s, strict=True))
    busy = tuple(m * (f + b) for f, b in zip(fwd_s, bwd_s, strict=True))
    return Timeline(makespan_s=m * period, rank_end_s=(m * period,) * len(busy),
                    rank_busy_s=busy, ops=())


def _plus(a: PieceCost, b: PieceCost) -> PieceCost:
    """Two pieces' figures added field by field."""
    return PieceCost(*(x + y for x, y in zip(a, b, strict=True)))


class CostModel:
    """Predicts time and memory of Plans for one model on one cluster."""

    def __init__(self, model: ModelSpec, cluster: Cluster,
                 coefficients: CostCoefficients | None = None, profile: Profile | None = None):
        self.model, self.cluster = model, cluster
        self.coef = coefficients or CostCoefficients()
        self.profile = profile or Profile()
        if self.profile.oversubscribed():  # no free core runs a collective beside compute
            self.coef = replace(self.coef, dp_overlap=0.0, zero3_overlap=0.0, tp_overlap=0.0)
        self.intra = {g.gpu.name: self._link(g.intra_link) for g in cluster.groups}
        self.inter = self._link(cluster.inter_link)
        ceilings = dict(self.coef.gpu_matmul_efficiency)  # GPU name -> GEMM ceiling
        self.efficiency = {g.gpu.name: self.profile.matmul_efficiency.get(
            g.gpu.name, ceilings.get(g.gpu.name, self.coef.matmul_efficiency))
            for g in cluster.groups}
        self._costers: dict[tuple, LayerCoster] = {}
        self._plan_costers: dict[int, tuple[Plan, LayerCoster]] = {}
        self._timelines: dict[tuple, Timeline] = {}
        self._chunk_params: dict[tuple[int, int, int], float] = {}
        self._rank_tails: dict[tuple, tuple[float, float]] = {}
        self.least_tails: dict[tuple, float] = {}
        """``cost.rank_terms.least_rank_tail_s`` by the plan fields it reads."""
        self.rank_layers: dict[tuple, tuple] = {}
        """The layer figures of the planner's per-rank bounds (plan/rank_bound.py)."""
        self.tail_lines: dict[tuple, tuple] = {}
        """The tail lines of the planner's per-rank bounds (plan/rank_bound.py)."""
        self.prechecks_cut = 0
        """How many ``assemble_below`` calls its precheck answered without a simulation (the
        stage search reads it to stop prechecking where that does not pay)."""

    def _link(self, spec: LinkSpec) -> comm.Link:
        """``spec`` at ``link_efficiency``, or as the Profile measured it."""
        link = comm.Link.from_spec(spec, self.coef.link_efficiency)
        bw = self.profile.link_bandwidth_gbps.get(spec.name)
        lat = self.profile.link_latency_us.get(spec.name)
        return comm.Link(lat * 1e-6 if lat is not None else link.latency_s,
                         bw * 1e9 if bw is not None else link.bandwidth_bps)

    def coster(self, plan: Plan) -> LayerCoster:
        """Per-layer costs of ``plan``'s layers (a segment's plan for its own layers), with the
        plan's flags (``layer_coster``; an fp32 residual stream where autocast runs without
        FSDP2's cast, ``autocast_stream``). Memoised per plan object (held, so its id is not
        reused while cached)."""
        found = self._plan_costers.get(id(plan))
        if found is not None and found[0] is plan:
            return found[1]
        if len(self._plan_costers) > 20_000:
            self._plan_costers.clear()
        coster = self.layer_coster(str(plan.dtype), cp=plan.cp,
                                   tp_comm_overlap=plan.tp_comm_overlap, compiled=plan.compile,
                                   stream32=autocast_stream(plan),
                                   fp8_scaling=str(plan.fp8_scaling))
        self._plan_costers[id(plan)] = (plan, coster)
        return coster

    def layer_coster(self, dtype: str, *, cp: int = 1, tp_comm_overlap: bool = False,
                     compiled: bool = True, stream32: bool = False,
                     fp8_scaling: str = "tensorwise") -> LayerCoster:
        """Per-layer costs in ``dtype``, each sequence split over ``cp`` ranks, tensor-parallel
        communication beside the GEMMs where ``tp_comm_overlap``, eager or compiled kernels
        (``Plan.compile``), over an fp32 stream where ``stream32``, float8 scaled as
        ``fp8_scaling``; by default as fused kernels over a 16-bit stream keep and run them
        (Korthikanti's counts, Megatron-LM). ``coster`` picks the flags of a plan."""
        key = (dtype, cp, tp_comm_overlap, compiled, stream32, fp8_scaling)
        coster = self._costers.get(key)
        if coster is None:
            if dtype == "fp8":  # a GPU without float8 tensor cores: refused, naming a way out
                for group in self.cluster.groups:
                    group.gpu.peak_flops("fp8")
            coster = self._costers[key] = LayerCoster(
                self, dtype=dtype, cp=cp, tp_comm_overlap=tp_comm_overlap, compiled=compiled,
                stream32=stream32, fp8_scaling=fp8_scaling)
        return coster

    # --- placement --------------------------------------------------------------------------
    def group_link(self, gpu: GPUSpec, span: int) -> comm.Link:
        """Link of a collective whose ranks lie within ``span`` consecutive ranks."""
        return self.intra[gpu.name] if span <= self.cluster.gpus_per_node else self.inter

    def default_gpu(self) -> GPUSpec:
        return self.cluster.groups[0].gpu

    def stage_gpu(self, stage: StagePlan) -> GPUSpec:
        if stage.gpu is None:
            return self.default_gpu()
        for group in self.cluster.groups:
            if group.gpu.name == stage.gpu:
                return group.gpu
        raise ValueError(f"stage runs on {stage.gpu!r} but the cluster has "
                         f"{', '.join(g.gpu.name for g in self.cluster.groups)}")

    @staticmethod
    def held(plan: Plan) -> HeldBytes:
        """Bytes per parameter a rank of ``plan`` holds (cost/state.py: what the runtime holds;
        a ``LayerPlan`` as the layerwise engine holds a layer run alone)."""
        return held_bytes_per_param(zero=plan.zero, dp=plan.grad_replicas, pp=plan.pp,
                                    dtype=plan.dtype, reduce_dtype=plan.reduce_dtype,
                                    per_layer=isinstance(plan, LayerPlan))

    @staticmethod
    def dp_traffic(plan: Plan) -> DataParallelTraffic:
        """What a rank of ``plan`` moves per step for data parallelism over dp x cp
        (cost/state.py; a ``LayerPlan`` as the layerwise engine moves a layer run alone)."""
        return data_parallel_traffic(zero=plan.zero, dp=plan.grad_replicas, pp=plan.pp,
                                     dtype=plan.dtype, reduce_dtype=plan.reduce_dtype,
                                     per_layer=isinstance(plan, LayerPlan))

    # --- pieces the planner reuses ------------------------------------------------------------
    def chunk_params(self, start: int, stop: int, tp: int) -> float:
        """Parameters of layers [start, stop) on one tensor-parallel rank (memoised)."""
        total = self._chunk_params.get((start, stop, tp))
        if total is None:
            total = 0.0
            for layer in self.model.layers[start:stop]:
                total += layer.tp_split_params / tp + (layer.params - layer.tp_split_params)
            if start == 0 and stop == self.model.num_layers:  # tied head and embedding on one rank
                total -= self.model.layers[-1].tied_params / tp
            self._chunk_params[(start, stop, tp)] = total
        return total

    def chunk_time(self, plan: Plan, start: int, stop: int, recompute: Sequence[Recompute],
                   gpu: GPUSpec, *, drop_tied: bool = False, units: int | None = None) -> PieceCost:
        """Layers [start, stop) as one unit under ``plan``'s tp/dp/ZeRO: a uniform chunk, or one
        segment (cost/segments.py). ``drop_tied``: the head's tied matrix is counted with the
        embedding; ``units``: its FSDP2 units (default each block and the chunk's root)."""
        layer = self.coster(plan).layer
        micro_batch, tp, sp = plan.micro_batch, plan.tp, plan.sequence_parallel
        costs = [layer(index, gpu, micro_batch, tp, sp, recompute[offset])
                 for offset, index in enumerate(range(start, stop))]
        # PieceCost's fwd_s .. cp_comm_s, each summed over the layers (0.0 for none)
        f, b, bg, wg, comp, re, tpc, cpc = (sum((c[i] for c in costs), 0.0) for i in range(8))
        params = self.chunk_params(start, stop, tp)
        if drop_tied:
            params -= self.model.layers[-1].tied_params / tp
        z3 = 0.0
        if plan.grad_replicas == 1:  # no data-parallel traffic inside a micro-batch
            return PieceCost(f, b, bg, wg, comp, re, tpc, cpc, z3, params)
        gathers, scatter = self.microbatch_dp_traffic(plan, params, gpu)
        if (gathers or scatter) and self.profile.collectives:
            # measured: FSDP2 issues one call per unit (each block and the chunk's root), so every
            # unit pays the fitted per-call time (FSDP2's own per-unit fits where measured,
            # profile/fsdp_units.py, else the collective's alpha), not the chunk once
            units = fsdp_units(self.model, start, stop) if units is None else units
            if self.fsdp_measured(plan):
                gathers, scatter = self.microbatch_dp_traffic(plan, params, gpu, units=units)
            else:
                one = self.microbatch_dp_traffic(plan, params / units, gpu)
                gathers, scatter = units * one[0], units * one[1]
        if gathers or scatter:
            ef, eb = self.zero_exposed(plan, gathers, scatter, f, b)
            f, b, bg, z3 = f + ef, b + eb, bg + eb, ef + eb
        return PieceCost(f, b, bg, wg, comp, re, tpc, cpc, z3, params)

    def stage_time(self, plan: Plan, segments: Sequence[Segment],
                   gpu: GPUSpec) -> tuple[PieceCost, list[PieceCost]]:
        """A chunk of ``plan`` from its segments: (the chunk's figures, each segment's). Between
        two segments whose tp differs the activation is redistributed (cost/transition.py):
        forward and backward seconds added to the chunk's, the backward in its input gradient."""
        pieces = [self.chunk_time(s.plan, s.start, s.stop, s.recompute, gpu, drop_tied=s.drop_tied,
                                  units=1 if s.alone else None) for s in segments]
        total = pieces[0]
        for at in range(1, len(segments)):
            step = transition(self, segments[at - 1].strategy, segments[at].strategy,
                              plan.dp * plan.micro_batch, plan.dtype, gpu,
                              sequence_parallel=plan.sequence_parallel)
            moved = PieceCost(step.fwd_s, step.bwd_s, step.bwd_s, 0.0, 0.0, 0.0, 0.0,
                              transition_s=step.fwd_s + step.bwd_s)
            total = _plus(_plus(total, pieces[at]), moved)
        return total, pieces

    def layer_alone(self, plan: Plan, index: int, recompute: Recompute, gpu: GPUSpec, *,
                    drop_tied: bool = False) -> tuple[PieceCost, float]:
        """Layer ``index`` as its own segment under ``plan`` (a layer of a layerwise stage, its
        ``layer_plan``): its per-micro-batch figures and its tail (its exposed gradient sync,
        parameter gathers and optimizer step; at an end of a pipeline split between ranks, the
        tied embedding's all-reduce too), as ``estimate`` adds them up."""
        piece = self.chunk_time(plan, index, index + 1, (recompute,), gpu, drop_tied=drop_tied,
                                units=1)
        own = self.coster(plan).layer(
            index, gpu, plan.micro_batch, plan.tp, plan.sequence_parallel, recompute)
        piece = piece._replace(activation_bytes=own.activation_bytes,
                               working_bytes=own.working_bytes, flops=own.flops)
        sync, optimizer = self.rank_tail(plan, piece.params, tail_overlap_window_s(piece), gpu)
        if index in (0, self.model.num_layers - 1):  # 0 unless tied and the ends are apart
            holder = plan.pp_rank_of_chunk(0 if index == 0 else plan.num_chunks - 1)
            sync += self.tied_embedding_sync_s(plan, holder, gpu)
        return piece, sync + optimizer

    def zero_exposed(self, plan: Plan, gathers: float, scatter: float, fwd_s: float,
                     bwd_s: float) -> tuple[float, float]:
        """(forward, backward) seconds the per-micro-batch ZeRO traffic adds: ZeRO-3 gathers
        half in forward, half in backward, reduce-scatters run in backward; a share
        ``zero3_overlap`` of the gathers hides where ``fsdp_prefetch`` is on, of the
        reduce-scatters where ``overlap_grad_reduce`` is on (none where off), and what hides
        slows the compute beside it by ``overlap_slowdown``."""
        gather_share = self.coef.zero3_overlap if plan.fsdp_prefetch else 0.0
        scatter_share = self.coef.zero3_overlap if plan.overlap_grad_reduce else 0.0
        slow = self.coef.overlap_slowdown
        return (comm.overlapped([(gathers / 2, gather_share)], fwd_s, slow),
                comm.overlapped([(gathers / 2, gather_share), (scatter, scatter_share)], bwd_s,
                                slow))

    def _bucketed(self, seconds: float, share: float, window_s: float, nbytes: float,
                  one_bucket_exposed: bool) -> float:
        """Exposed seconds of a collective moving ``nbytes`` bucket by bucket beside compute
        lasting ``window_s``: up to ``share`` of it hides (0: none), slowing the compute by
        ``overlap_slowdown``; with ``one_bucket_exposed`` one ``grad_bucket_bytes`` bucket's
        share (the last gradients', the first unit's parameters) never hides."""
        floor = seconds * min(1.0, self.coef.grad_bucket_bytes / max(nbytes, 1.0)) \
            if one_bucket_exposed else 0.0
        return comm.overlapped([(seconds, share)], window_s, self.coef.overlap_slowdown,
                               least_exposed_s=floor)

    def fsdp_measured(self, plan: Plan) -> bool:
        """Whether the Profile measured FSDP2's per-unit calls for this plan's dp group (a plan
        whose parameters FSDP2 shards)."""
        d = plan.grad_replicas
        return fsdp_shards(zero=plan.zero, dp=d, per_layer=isinstance(plan, LayerPlan)) and \
            f"fsdp_all_gather/{d}" in self.profile.collectives and \
            f"fsdp_reduce_scatter/{d}" in self.profile.collectives

    def fsdp_calls(self, kind: str, n: int, calls: float, nbytes: float, units: int) -> float:
        """Seconds of ``calls`` FSDP2 calls of ``kind`` over each of ``units`` units sharing
        ``nbytes`` (the Profile's ``fsdp_<kind>/n`` fit: linear, so an even split is exact)."""
        if calls <= 0 or nbytes <= 0:
            return 0.0
        return calls * units * (self.profile.collective_s(f"fsdp_{kind}", n, nbytes / units) or 0.0)

    def microbatch_dp_traffic(self, plan: Plan, params: float, gpu: GPUSpec,
                              units: int = 0) -> tuple[float, float]:
        """(all-gather, reduce-scatter) seconds of the data-parallel collectives inside one
        micro-batch over ``params`` (cost/state.py: ZeRO-3's gathers, ZeRO-2/3's gradient
        reduce-scatter) over dp x cp (``Plan.grad_replicas``); ``units`` > 0 prices them as that
        many FSDP2 units from the Profile's measured per-unit fits."""
        d = plan.grad_replicas
        traffic = self.dp_traffic(plan)
        if d == 1:
            return 0.0, 0.0
        if units > 0:
            c = compute_bytes(plan.dtype)  # bytes per parameter an all-gather moves
            return (self.fsdp_calls("all_gather", d,
                                    traffic.all_gather_per_microbatch * d / c, params * c, units),
                    self.fsdp_calls("reduce_scatter", d, 1.0,
                                    params * traffic.reduce_scatter_per_microbatch, units))
        link = self.group_link(gpu, plan.tp * d)
        # an all-gather's input is 1/d of the buffer it fills: the buffer is d x the input
        gathered = params * traffic.all_gather_per_microbatch * d
        return (self.collective("all_gather", d, gathered, link),
                self.collective("reduce_scatter", d,
                                params * traffic.reduce_scatter_per_microbatch, link))

    def rank_memory(self, plan: Plan, pp_rank: int,
                    chunks: Sequence[tuple[int, int, Sequence[Recompute]]],
                    gpu: GPUSpec) -> StageMemory:
        """Peak memory of one rank of pipeline rank ``pp_rank`` holding ``chunks`` (start, stop,
        recompute) under ``plan``'s own strategy (``segments_memory`` of their segments)."""
        return self.segments_memory(
            plan, pp_rank, [Segment(a, b, plan, tuple(r)) for a, b, r in chunks], gpu)

    def segments_memory(self, plan: Plan, pp_rank: int, segments: Sequence[Segment],
                        gpu: GPUSpec) -> StageMemory:
        """Peak memory of one rank of pipeline rank ``pp_rank`` holding ``segments``, added up per
        strategy from ``rank_memory_terms`` (cost/rank_terms.py), the terms the planner's bounds
        read; the head's loss buffers are reserved under the head's strategy."""
        stored = working = 0.0
        groups: dict[int, list] = {}  # per strategy (one plan object each): [plan, params, largest]
        tied, last = self.model.layers[-1].tied_params, self.model.num_layers - 1
        head_plan = plan
        for segment in segments:
            sub = segment.plan
            group = groups.setdefault(id(sub), [sub, 0.0, 0.0])
            layer = self.coster(sub).layer
            micro_batch, tp, sp = sub.micro_batch, sub.tp, sub.sequence_parallel
            # a tied head in a chunk of its own (the V's rank 0 holds chunks 0 and 2pp - 1) is a
            # second parameter the runtime holds, reduces and updates (run/engine/train_engine.py
            # sums the two gradients); chunk_params drops it only where one chunk holds both ends
            group[1] += self.chunk_params(segment.start, segment.stop, tp) \
                - (tied / tp if segment.drop_tied else 0.0)
            for offset, index in enumerate(range(segment.start, segment.stop)):
                cost = layer(index, gpu, micro_batch, tp, sp, segment.recompute[offset])
                stored += cost.activation_bytes
                working = max(working, cost.working_bytes)
                own = self.chunk_params(index, index + 1, tp)
                if segment.drop_tied and index == last:
                    own -= tied / tp
                group[2] = max(group[2], own)
            if segment.stop == last + 1:
                head_plan = sub
        # ZeRO as the runtime realises it (cost/state.py); ZeRO-3 gathers its largest layer
        params = grads = optimizer = extra = gather = 0.0
        rank = None
        for sub, count, largest in groups.values():
            held = self.held(sub)
            terms = rank_memory_terms(self, sub, pp_rank, gpu)
            if sub is head_plan is plan:
                rank = terms
            params += count * (held.params + terms.weight_copy_bytes_per_param)
            grads += count * held.grads
            optimizer += count * held.optimizer
            extra += count * held.peak_extra
            gather = max(gather, largest * terms.gather_bytes_per_param)
        if rank is None:
            rank = rank_memory_terms(self, plan, pp_rank, gpu, head_plan=head_plan)
        return StageMemory(params=params, grads=grads, optimizer=optimizer,
                           activations=rank.activation_bytes(stored, working),
                           buffers=gather + extra, reserved=rank.reserved_bytes,
                           in_flight_microbatches=rank.in_flight)

    def rank_tail(self, plan: Plan, params: float, last_bwd_s: float, gpu: GPUSpec,
                  units: int = 1, least: bool = False) -> tuple[float, float]:
        """(exposed data-parallel sync, optimizer step) of a rank's step beyond its compute: the
        gradient reduction after the last backward (whose compute lasts ``last_bwd_s``) and the
        once-per-step parameter all-gather of ZeRO-1/2 before or beside the next forward (half
        the backward), each hidden as far as the plan's overlap switches allow; ``units``: the
        rank's FSDP2 units (priced per unit where the Profile measured them); ``least``: without
        the first and last buckets' floors (a lower bound affine in the traffic, for the
        planner). Gradients are reduced over dp x cp (``Plan.grad_replicas``). Memoised by the
        plan fields it reads."""
        key = (type(plan), plan.tp, plan.dp, plan.cp, plan.pp, plan.zero, plan.dtype,
               plan.reduce_dtype, plan.overlap_grad_reduce, plan.overlap_param_gather, params,
               last_bwd_s, gpu.name, gpu.hbm_gbps, units, least)
        found = self._rank_tails.get(key)
        if found is not None:
            return found
        if len(self._rank_tails) > 200_000:
            self._rank_tails.clear()
        d = plan.grad_replicas
        exposed = sum(self._bucketed(part.seconds, part.share, last_bwd_s * part.window,
                                     part.nbytes, not least)
                      for part in self.sync_parts(plan, params, gpu, units))
        if self.profile.collectives:  # the step's two scalar all-reduces (loss, gradient norm)
            exposed += 2 * (self.profile.collective_s("all_reduce", plan.world_size, 8.0) or 0.0)
        shard = d if plan.zero >= 1 else 1
        optimizer = params / shard * self.coef.optimizer_bytes_per_param / (gpu.hbm_gbps * 1e9)
        if self.profile.optimizer_s_per_param > 0:  # measured: fixed + per-parameter tail
            optimizer = self.profile.optimizer_fixed_s + params / shard * self.profile.optimizer_s_per_param
        self._rank_tails[key] = exposed, optimizer
        return exposed, optimizer

    def sync_parts(self, plan: Plan, params: float, gpu: GPUSpec,
                   units: int = 1) -> tuple[SyncPart, SyncPart]:
        """The data-parallel collectives of a rank holding ``params`` after its last backward,
        as ``rank_tail`` hides them: the gradient reduction (all-reduce, or reduce-scatter
        under ZeRO) and ZeRO-1/2's parameter all-gather, over dp x cp."""
        d = plan.grad_replicas
        traffic = self.dp_traffic(plan)
        link = self.group_link(gpu, plan.tp * d)
        reduce = self.collective("all_reduce", d, params * traffic.all_reduce_per_step, link)
        gathered = params * traffic.all_gather_per_step * d  # the buffer the gathers fill
        measured = self.fsdp_measured(plan)  # ZeRO-1/2/3: FSDP2's per-step calls, measured

        def priced(kind: str, nbytes: float) -> float:
            return self.fsdp_calls(kind, d, 1.0, nbytes, units) if measured \
                else self.collective(kind, d, nbytes, link)

        reduce += priced("reduce_scatter", params * traffic.reduce_scatter_per_step)
        grad_bytes = params * (traffic.all_reduce_per_step + traffic.reduce_scatter_per_step)
        # overlap_grad_reduce: buckets reduce while the last backward runs, but the last one
        # waits for the last gradient; overlap_param_gather (FSDP2's units of a whole chunk, not
        # a LayerPlan's layer run alone): each unit's gather runs while the unit before it
        # computes in the first forward, but the first unit's waits in front of it
        gather_hides = plan.overlap_param_gather and not isinstance(plan, LayerPlan)
        return (SyncPart(reduce, self.coef.dp_overlap if plan.overlap_grad_reduce else 0.0, 1.0,
                         grad_bytes),
                SyncPart(priced("all_gather", gathered),
                         self.coef.zero3_overlap if gather_hides else 0.0, 0.5, gathered))

    def collective(self, kind: str, n: int, nbytes: float, link: comm.Link) -> float:
        """Seconds of one collective: the Profile's alpha-beta fit of this kind and group size
        where it has one, else the ring formula over ``link`` (cost/comm.py)."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        measured = self.profile.collective_s(kind, n, nbytes)
        if measured is not None:
            return measured
        return getattr(comm, kind)(n, nbytes, link)

    def p2p_time(self, plan: Plan, gpu: GPUSpec) -> float:
        """Sending one micro-batch's hidden state to the next stage (split over tp ranks, as
        Megatron's scatter/gather does, and over cp ranks, each sending its own tokens)."""
        nbytes = activation_bytes(self, plan.micro_batch, plan.dtype) / plan.tp / plan.cp
        measured = self.profile.collective_s("send_recv", 2, nbytes)
        return measured if measured is not None else \
            comm.p2p(nbytes, self.group_link(gpu, plan.world_size))

    def tied_embedding_sync_s(self, plan: Plan, pp_rank: int, gpu: GPUSpec) -> float:
        """The all-reduce that sums a tied embedding's gradient over the two pipeline ranks
        holding the embedding and the head (Megatron's embedding group; run/engine/train_engine.py's tied
        group), after the last backward and before the optimizer: V h / t gradients in the
        plan's reduce dtype (a 1/dp shard under FSDP2); 0 on the other ranks, without a
        pipeline, or where one rank holds both (the V schedules)."""
        first, last = plan.pp_rank_of_chunk(0), plan.pp_rank_of_chunk(plan.num_chunks - 1)
        if not self.model.tied_embeddings or first == last or pp_rank not in (first, last):
            return 0.0
        grads = self.model.layers[-1].tied_params / plan.tp
        if fsdp_shards(zero=plan.zero, dp=plan.grad_replicas,
                       per_layer=isinstance(plan, LayerPlan)):  # FSDP2 shards over dp x cp
            grads /= plan.grad_replicas
        nbytes = grads * compute_bytes(plan.reduce_dtype)
        return self.collective("all_reduce", 2, nbytes, self.group_link(gpu, plan.world_size))

    # --- the whole plan ------------------------------------------------------------------------
    def estimate(self, plan: Plan) -> Estimate:
        """Step time and memory of ``plan``: each chunk priced as its segments
        (cost/segments.py), the schedule simulated over the chunks, each rank's step ending
        with its tail."""
        model = self.model.with_seq_len(plan.seq_len)
        if model is not self.model:
            return CostModel(model, self.cluster, self.coef, self.profile).estimate(plan)
        plan.check_against(model)
        if plan.schedule == Schedule.ASYNC and lists_layer_strategies(plan):
            raise PlanError(f"layerwise plans run a synchronous schedule, not {plan.schedule}; "
                            "drop layer_strategies or change the schedule")
        gpus = [self.stage_gpu(stage) for stage in plan.stages]
        plans: dict = {}
        times, parts = [], []
        for chunk, gpu in enumerate(gpus):
            segments = chunk_segments(model, plan, chunk, plans)
            time, pieces = self.stage_time(plan, segments, gpu)
            times.append(time)
            parts.append(list(zip(segments, pieces, strict=True)))
        return self.assemble(plan, gpus, times, parts)

    def _timeline(self, plan: Plan, gpus: Sequence[GPUSpec], times: Sequence[PieceCost]
                  ) -> tuple[Timeline, tuple[float, ...] | None]:
        """The schedule simulated over the chunks' times, and for an asynchronous plan each
        rank's optimizer step (inside its simulated steady state, cost/pipeline.py)."""
        p, m, v = plan.pp, plan.num_microbatches, plan.vpp
        zb = plan.schedule.split_backward  # input and weight gradients apart
        p2p = tuple(self.p2p_time(plan, g) for g in gpus)
        fwd = tuple(t.fwd_s for t in times)
        bwd = tuple(t.bgrad_s if zb else t.bwd_s for t in times)
        wgrad = tuple(t.wgrad_s for t in times) if zb else None
        steps = tuple(self.rank_tail(plan, sum(times[c].params for c in plan.chunks_of(k)),
                                     0.0, gpus[k])[1] for k in range(p)) \
            if plan.schedule == Schedule.ASYNC else None
        # plans that differ only in what the simulation does not see (ZeRO 0/1/2, the tail)
        # share one simulation
        key = (plan.schedule, p, m, v, fwd, bwd, wgrad, p2p, steps)
        timeline = self._timelines.get(key)
        if timeline is None:
            if len(self._timelines) > 50_000:
                self._timelines.clear()
            timeline = self._timelines[key] = simulate(plan.schedule, p, m, fwd, bwd, v=v,
                                                       wgrad_s=wgrad, p2p_s=p2p) \
                if steps is None else async_steady_step(p, m, fwd, bwd, p2p_s=p2p, step_s=steps)
        return timeline, steps

    def rank_tails(self, plan: Plan, pp_rank: int, parts: Sequence[tuple[Segment, PieceCost]],
                   gpu: GPUSpec) -> tuple[float, float, float]:
        """(exposed gradient sync, optimizer step, tied embedding all-reduce) after the last
        backward of a rank holding ``parts``: the segments that reduce together (a uniform
        rank's chunks) as one unit, each segment reduced alone (a layer of a layerwise stage) as
        its own. The overlap window is the unit's first piece's compute without recompute, so
        that more recompute never shortens the step (the planner's per-stage choice relies on
        it). The tied all-reduce runs under the strategy of the end the rank holds."""
        units: list[Sequence[tuple[Segment, PieceCost]]] = [parts]
        if any(segment.alone for segment, _ in parts):
            units = [[part] for part in parts if part[0].alone]
            together = [part for part in parts if not part[0].alone]
            units += [together] if together else []
        sync = optimizer = 0.0
        ends = plan
        last = self.model.num_layers
        for unit in units:
            first, piece = unit[0]
            sub = first.plan
            s, o = self.rank_tail(sub, sum(t.params for _, t in unit), tail_overlap_window_s(piece),
                                  gpu, units=sum(segment.units(self.model) for segment, _ in unit)
                                  if self.fsdp_measured(sub) else 1)
            sync, optimizer = sync + s, optimizer + o
            if first.start == 0 or unit[-1][0].stop == last:
                ends = sub  # the end's (one strategy: a unit of several is uniform)
        tied = self.tied_embedding_sync_s(ends, pp_rank, gpu)
        return sync + tied, optimizer, tied

    def assemble(self, plan: Plan, gpus: Sequence[GPUSpec], times: Sequence[PieceCost],
                 parts: Parts | None = None) -> Estimate:
        """The Estimate of ``plan`` whose chunks cost ``times`` (``parts``: each chunk's
        segments with their figures; default one segment per chunk under the plan)."""
        estimate = self.assemble_below(plan, gpus, times, math.inf, parts)
        assert estimate is not None
        return estimate

    def assemble_below(self, plan: Plan, gpus: Sequence[GPUSpec], times: Sequence[PieceCost],
                       bound: float, parts: Parts | None = None, *,
                       fitting: bool = False, precheck: bool = True) -> Estimate | None:
        """``assemble``, or None when the step is not below ``bound`` (then its memory is not
        added up: the planner prices many plans only to compare their steps); with ``fitting``
        also None when the plan does not fit memory (then its schedule is not simulated).
        ``precheck``: first try to prove the step not below ``bound`` from each rank's own
        work, fill, drain and tail (``_rank_ends``), without simulating (the same answer
        either way)."""
        p, m = plan.pp, plan.num_microbatches
        layerwise = parts is not None and lists_layer_strategies(plan)
        if parts is None:
            parts = [[(Segment(s.start, s.stop, plan, s.recompute), times[c])]
                     for c, s in enumerate(plan.stages)]
        # per pipeline rank: its GPU (every rank's tp x dp GPUs share the GPU type of its first
        # chunk), its segments with their figures, and its tail
        chunks = [plan.chunks_of(k) for k in range(p)]
        rank_gpus = [gpus[ids[0]] for ids in chunks]
        ranks = [[part for c in ids for part in parts[c]] for ids in chunks]
        tails = [self.rank_tails(plan, k, rank, gpu)
                 for k, (rank, gpu) in enumerate(zip(ranks, rank_gpus, strict=True))]
        # some rank's own work and tail already reach the bound: no simulation (with a margin
        # for the simulation's rounding, so that a step proven not below ``bound`` never is)
        if precheck and plan.schedule != Schedule.ASYNC and bound < math.inf and any(
                end * (1.0 - 1e-9) + sync + opt >= bound
                for end, (sync, opt, _) in zip(self._rank_ends(plan, times), tails, strict=True)):
            self.prechecks_cut += 1
            return None
        def segments() -> Iterator[list[Segment]]:  # each rank's, as its memory is added up
            return ([segment for segment, _ in rank] for rank in ranks)

        memory = self._memory(plan, segments(), rank_gpus, fitting=True) if fitting else None
        if fitting and memory is None:
            return None
        timeline, steps = self._timeline(plan, gpus, times)
        # an asynchronous plan's m optimizer steps are already inside the simulated window
        ends = [end + sync + (opt if steps is None else 0.0)
                for end, (sync, opt, _) in zip(timeline.rank_end_s, tails, strict=True)]
        if steps is not None:
            tails = [(sync, m * s, tied) for (sync, _, tied), s in zip(tails, steps, strict=True)]
        step = max(ends)
        if step >= bound:
            return None
        if memory is None:
            memory = self._memory(plan, segments(), rank_gpus)
        crit = ends.index(step)
        tokens = plan.global_batch * plan.seq_len
        model_flops = tokens * self.model.model_flops_per_token()
        hw_flops = tokens * sum(
            3 * layer.fwd_flops_per_token + layer.recompute_flops_per_token.get(mode, 0.0)
            for layer, mode in zip(self.model.layers, plan.recompute_of_layer(), strict=True)
        )
        world = plan.world_size
        peak = sum(gpu.peak_flops(flops_dtype(plan.dtype)) for gpu in rank_gpus) * world / p
        return Estimate(
            step_time_s=step,
            tokens_per_s=tokens / step,
            tflops_per_gpu=hw_flops / step / world / 1e12,
            model_tflops_per_gpu=model_flops / step / world / 1e12,
            mfu=model_flops / step / peak,
            bubble_fraction=timeline.bubble_fraction,
            memory=tuple(memory),
            memory_budget_bytes=tuple(gpu.memory_bytes for gpu in rank_gpus),
            breakdown_s=self._breakdown(plan, times, timeline, crit, tails[crit], layerwise),
            stage_times_s=tuple((t.fwd_s, t.bwd_s) for t in times),
        )

    def _memory(self, plan: Plan, ranks: Iterable[Sequence[Segment]],
                rank_gpus: Sequence[GPUSpec], *, fitting: bool = False) -> list[StageMemory] | None:
        """Each rank's memory (``ranks``: each one's segments, read as they are reached); with
        ``fitting`` None as soon as one rank's exceeds its GPU's."""
        memory = []
        for k, (rank, gpu) in enumerate(zip(ranks, rank_gpus, strict=True)):
            held = self.segments_memory(plan, k, rank, gpu)
            if fitting and held.total > gpu.memory_bytes:
                return None
            memory.append(held)
        return memory

    def stages_fit(self, plan: Plan, gpus: Sequence[GPUSpec],
                   stages: Sequence[StagePlan]) -> bool:
        """Whether ``plan`` with ``stages`` (chunk c on ``gpus[c]``) fits every rank's memory, as
        ``assemble_below(..., fitting=True)`` decides it, without building the plan (memory reads
        its strategy and the stages, not the plan's own stages)."""
        chunks = [plan.chunks_of(k) for k in range(plan.pp)]
        segments = ([Segment(stages[c].start, stages[c].stop, plan, stages[c].recompute)
                     for c in ids] for ids in chunks)
        return self._memory(plan, segments, [gpus[ids[0]] for ids in chunks],
                            fitting=True) is not None

    def reaches_bound(self, plan: Plan, gpus: Sequence[GPUSpec], times: Sequence[PieceCost],
                      spans: Sequence[tuple[int, int]], bound: float) -> bool:
        """Whether some rank's own work and tail prove the step of ``plan`` with uniform chunks
        over ``spans`` (start, stop) costing ``times`` not below ``bound`` (``assemble_below``
        then returns None), without building the plan's stages (the tails read only its
        strategy); the ranks that end last first, each one's tail priced only when reached."""
        if plan.schedule == Schedule.ASYNC:
            return False
        ends = self._rank_ends(plan, times)
        for k in sorted(range(plan.pp), key=ends.__getitem__, reverse=True):
            chunk_ids = plan.chunks_of(k)
            rank = [(Segment(*spans[c], plan, ()), times[c]) for c in chunk_ids]
            sync, opt, _ = self.rank_tails(plan, k, rank, gpus[chunk_ids[0]])
            if ends[k] * (1.0 - 1e-9) + sync + opt >= bound:
                return True
        return False

    @staticmethod
    def _rank_ends(plan: Plan, times: Sequence[PieceCost]) -> list[float]:
        """No simulated rank ends sooner: it starts no action before micro-batch 0's forwards
        through the chunks before its first one, then runs its m forwards and backwards one
        after another (with the fill and the drain: ``_filled``, then ``_drained_chunks`` from
        the shape's action list or, before it is at hand, ``_drained`` for one chunk per rank)."""
        m = plan.num_microbatches
        split = plan.schedule.split_backward
        back = [t.bgrad_s if split else t.bwd_s for t in times]  # B, or I under a split backward
        # micro-batch 0's forwards through chunks 0..c-1 (transfers left out)
        chain = list(accumulate((t.fwd_s for t in times), initial=0.0))
        # a split backward runs as I + W, or (DualPipeV) some as one full B
        whole = [min(t.bwd_s, t.bgrad_s + t.wgrad_s) if split else t.bwd_s for t in times]
        ends, busy = [], []
        for k in range(plan.pp):
            chunks = plan.chunks_of(k)
            busy.append(m * sum((times[c].fwd_s + whole[c] for c in chunks), 0.0))
            ends.append(chain[min(chunks)] + busy[-1])
        ends = CostModel._filled(plan, times, chain, back, ends, busy)
        drain = known_drain(plan.schedule, plan.pp, m, plan.vpp)
        if drain is not None:
            return CostModel._drained_chunks(plan, times, chain, back, ends, drain)
        if plan.num_chunks == plan.pp:
            return CostModel._drained(plan, times, chain, back, ends)
        return ends

    @staticmethod
    def _filled(plan: Plan, times: Sequence[PieceCost], chain: Sequence[float],
                back: Sequence[float], ends: list[float], busy: Sequence[float]) -> list[float]:
        """``_rank_ends`` with the fill: rank k's first backward (``back``) of chunk c waits for
        its micro-batch's forwards through every chunk and backwards through the chunks after c,
        and only the warm-up forwards its action list runs before it (``forwards_before_backward``,
        once the shape was simulated) can run sooner."""
        warm = known_warmup(plan.schedule, plan.pp, plan.num_microbatches, plan.vpp)
        if warm is None:  # a shape not simulated yet: its action list is not generated for this
            return ends
        # later[c]: backwards of the chunks after c - 1
        later = list(accumulate(reversed(back), initial=0.0))[::-1]
        filled = list(ends)
        for k, (first, count) in enumerate(warm):
            early = sum(n * times[c].fwd_s for c, n in enumerate(count) if n)
            filled[k] = max(filled[k], chain[-1] + later[first + 1] + busy[k] - early)
        return filled

    @staticmethod
    def _drained(plan: Plan, times: Sequence[PieceCost], chain: Sequence[float],
                 back: Sequence[float], ends: list[float]) -> list[float]:
        """``_rank_ends`` of a one-chunk-per-rank pipeline with the drain, before its action
        list is at hand: the last backward (``back``) to end on rank j ends no sooner than
        chain_j + m (f_j + b_j) (every F and B of rank j after the chain, each F before its B),
        and that micro-batch's backward then passes ranks j - 1, ..., k in turn, so rank k ends
        no sooner than that plus b_{j-1} + ... + b_k, for every j >= k (``_drained_chunks``
        once the list is known)."""
        m, p = plan.num_microbatches, plan.pp
        drained = list(ends)
        latest = -math.inf  # max over j > k of (rank j's last B's end + b_{k+1} + ... + b_{j-1})
        for k in range(p - 2, -1, -1):
            latest += back[k + 1] if latest > -math.inf else 0.0
            latest = max(latest, chain[k + 1] + m * (times[k + 1].fwd_s + back[k + 1]))
            drained[k] = max(drained[k], latest + back[k])
        return drained

    @staticmethod
    def _drained_chunks(plan: Plan, times: Sequence[PieceCost], chain: Sequence[float],
                        back: Sequence[float], ends: list[float],
                        drain: Drain) -> list[float]:
        """``_rank_ends`` with the drain, from the shape's action list (``known_drain``, once
        it was simulated; any chunks per rank): rank j's last backward, of chunk c_j, ends no
        sooner than the chain
        to its first chunk plus every action its list runs up to it; that micro-batch's
        backward then passes chunks c_j - 1, ..., 0 in turn, so the rank of each such chunk
        ends no sooner than its arrival there (and, where that is the rank's own last
        backward and every rank's last backward is of one micro-batch, what it runs after)."""
        split = plan.schedule.split_backward

        def run_s(counts: Sequence[tuple[int, int, int, int, int]]) -> float:
            total = 0.0
            for c, f, b, i, w in counts:
                t = times[c]
                total += f * t.fwd_s + b * (t.bgrad_s + t.wgrad_s if split else t.bwd_s) \
                    + i * t.bgrad_s + w * t.wgrad_s
            return total

        one_batch = len({rank.microbatch for rank in drain}) == 1
        last_end = [0.0] * (len(times) + 1)  # by chunk: the latest last backward ending there
        for k, rank in enumerate(drain):
            end = chain[min(plan.chunks_of(k))] + run_s(rank.before)
            last_end[rank.chunk] = max(last_end[rank.chunk], end)
        drained = list(ends)
        latest = -math.inf  # the latest arrival of such a chain at chunk c's backward end
        for c in range(len(times) - 1, -1, -1):
            latest = max(latest + back[c], last_end[c + 1] + back[c]) if c + 1 < len(times) \
                else -math.inf
            if latest == -math.inf:
                continue
            k = plan.pp_rank_of_chunk(c)
            own = drain[k]
            tail = run_s(own.after) if one_batch and own.chunk == c else 0.0
            drained[k] = max(drained[k], latest + tail)
        return drained

    @staticmethod
    def _breakdown(plan: Plan, times: Sequence[PieceCost], timeline: Timeline, crit: int,
                   tail: tuple[float, float, float], layerwise: bool) -> dict[str, float]:
        """The step's terms on the rank that ends last (``crit``), whose tail is (sync with the
        tied all-reduce, optimizer, tied all-reduce)."""
        crit_chunks = plan.chunks_of(crit)

        def per_step(name: str) -> float:  # a PieceCost field over the rank's chunks, m times
            return sum(getattr(times[c], name) for c in crit_chunks) * plan.num_microbatches

        breakdown = {
            "compute": per_step("compute_s"),
            "recompute": per_step("recompute_s"),
            "tp_comm": per_step("tp_comm_s"),
            "zero3_comm_exposed": per_step("zero3_comm_s"),
            "pp_bubble": timeline.rank_end_s[crit] - timeline.rank_busy_s[crit],
            "dp_comm_exposed": tail[0] - tail[2],
            "embedding_sync": tail[2],
            "optimizer": tail[1],
        }
        if plan.cp > 1:  # the ring's K/V exchange beyond each step's attention block
            breakdown["cp_comm_exposed"] = per_step("cp_comm_s")
        if layerwise:  # activations moved between layers of different tp
            breakdown["transitions"] = per_step("transition_s")
        return breakdown
