"""CostModel: a Plan in, an Estimate out (time by simulating the schedule, memory per stage).

Rank placement follows the Plan: tensor parallel innermost (inside a node), then context
parallel, then data parallel, then pipeline. A collective runs over NVLink/PCIe while its group
fits in a node, otherwise at the inter-node NIC's speed. Parameters are replicated over dp x cp
(``Plan.grad_replicas``): gradient reductions and ZeRO sharding span that group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from meshmorph.cost import comm
from meshmorph.cost.coefficients import CostCoefficients
from meshmorph.cost.estimate import Estimate, StageMemory
from meshmorph.cost.layer_cost import LayerCoster
from meshmorph.cost.pipeline import Timeline, async_steady_step, simulate
from meshmorph.cost.profile import Profile
from meshmorph.cost.rank_terms import (
    rank_memory_terms,
    tail_overlap_window_s,
)
from meshmorph.cost.state import (
    HeldBytes,
    data_parallel_traffic,
    gather_bytes_per_param,
    held_bytes_per_param,
)
from meshmorph.schedule.table import Schedule
from meshmorph.spec.cluster import Cluster
from meshmorph.spec.gpus import GPUSpec, LinkSpec
from meshmorph.spec.model import ModelSpec, Recompute
from meshmorph.spec.plan import Plan, StagePlan


def steady_state(fwd_s: Sequence[float], bwd_s: Sequence[float], m: int) -> Timeline:
    """Asynchronous 1F1B (no flush) priced in its steady state: the slowest stage paces every
    micro-batch, ``m * max_k (f_k + b_k)`` per step on every rank, no fill or drain bubble
    (transfers overlap compute in the steady state)."""
    period = max(f + b for f, b in zip(fwd_s, bwd_s, strict=True))
    busy = tuple(m * (f + b) for f, b in zip(fwd_s, bwd_s, strict=True))
    return Timeline(makespan_s=m * period, rank_end_s=(m * period,) * len(busy),
                    rank_busy_s=busy, ops=())


@dataclass(frozen=True, slots=True)
class ChunkTime:
    """Per-micro-batch times of one model chunk on one rank."""

    fwd_s: float
    """Forward, exposed TP and ZeRO-3 communication included."""
    bwd_s: float
    """Backward (input and weight gradients), recompute and exposed communication included."""
    bgrad_s: float
    """The input-gradient part of bwd_s (zero-bubble B op)."""
    wgrad_s: float
    """The weight-gradient part of bwd_s (zero-bubble W op)."""
    compute_s: float
    """Forward + backward compute without recompute and communication."""
    recompute_s: float
    """Recomputed forward compute."""
    tp_comm_s: float
    """Exposed tensor-parallel communication."""
    zero3_comm_s: float
    """Exposed per-micro-batch ZeRO gathers and reduce-scatters (ZeRO-3; ZeRO-2's scatters)."""
    params: float
    """Parameters of the chunk on one tensor-parallel rank (before ZeRO sharding)."""
    cp_comm_s: float = 0.0
    """Exposed context-parallel ring exchange (in fwd_s and bwd_s)."""


class CostModel:
    """Predicts time and memory of Plans for one model on one cluster."""

    def __init__(self, model: ModelSpec, cluster: Cluster,
                 coefficients: CostCoefficients | None = None, profile: Profile | None = None):
        self.model = model
        self.cluster = cluster
        self.coef = coefficients or CostCoefficients()
        self.profile = profile or Profile()
        if self.profile.oversubscribed():  # no free core runs a collective beside compute
            self.coef = replace(self.coef, dp_overlap=0.0, zero3_overlap=0.0, tp_overlap=0.0)
        eff = self.coef.link_efficiency
        self.intra = {g.gpu.name: self._link(g.intra_link.name, g.intra_link, eff) for g in cluster.groups}
        self.inter = self._link(cluster.inter_link.name, cluster.inter_link, eff)
        self.efficiency = {
            g.gpu.name: self.profile.matmul_efficiency.get(g.gpu.name, self.coef.matmul_efficiency)
            for g in cluster.groups
        }
        self._costers: dict[str, LayerCoster] = {}
        self._timelines: dict[tuple, Timeline] = {}

    def _link(self, name: str, spec: LinkSpec, efficiency: float) -> comm.Link:
        link = comm.Link.from_spec(spec, efficiency)
        bw = self.profile.link_bandwidth_gbps.get(name)
        lat = self.profile.link_latency_us.get(name)
        return comm.Link(lat * 1e-6 if lat is not None else link.latency_s,
                         bw * 1e9 if bw is not None else link.bandwidth_bps)

    def coster(self, dtype: str, cp: int = 1, tp_comm_overlap: bool = False) -> LayerCoster:
        """Per-layer costs in ``dtype`` with each sequence split over ``cp`` ranks, tensor-parallel
        communication beside the GEMMs where ``tp_comm_overlap`` (``Plan.tp_comm_overlap``)."""
        key = (dtype if cp == 1 else f"{dtype}/cp{cp}") + ("/tpo" if tp_comm_overlap else "")
        if key not in self._costers:
            self._costers[key] = LayerCoster(self.model, self.coef, dtype=dtype,
                                             efficiency=self.efficiency, tp_link=self.intra,
                                             profile=self.profile, cp=cp,
                                             inter_link=self.inter,
                                             gpus_per_node=self.cluster.gpus_per_node,
                                             tp_comm_overlap=tp_comm_overlap)
        return self._costers[key]

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
        """Bytes per parameter a rank of ``plan`` holds (cost/state.py: what the runtime holds)."""
        return held_bytes_per_param(zero=plan.zero, dp=plan.grad_replicas, pp=plan.pp,
                                    dtype=plan.dtype)

    # --- pieces the planner reuses ------------------------------------------------------------
    def chunk_params(self, start: int, stop: int, tp: int) -> float:
        """Parameters of layers [start, stop) on one tensor-parallel rank."""
        total = 0.0
        for layer in self.model.layers[start:stop]:
            total += layer.tp_split_params / tp + (layer.params - layer.tp_split_params)
        if start == 0 and stop == self.model.num_layers:
            total -= self.model.layers[-1].tied_params / tp  # tied head and embedding on one rank
        return total

    def chunk_time(self, plan: Plan, start: int, stop: int, recompute: Sequence[Recompute],
                   gpu: GPUSpec) -> ChunkTime:
        coster = self.coster(plan.dtype, plan.cp, plan.tp_comm_overlap)
        f = b = bg = wg = comp = re = tpc = cpc = 0.0
        for offset, index in enumerate(range(start, stop)):
            cost = coster.layer(index, gpu, plan.micro_batch, plan.tp, plan.sequence_parallel,
                                recompute[offset])
            f += cost.fwd_s
            b += cost.bwd_s
            bg += cost.bgrad_s
            wg += cost.wgrad_s
            comp += cost.compute_s
            re += cost.recompute_s
            tpc += cost.tp_comm_s
            cpc += cost.cp_comm_s
        params = self.chunk_params(start, stop, plan.tp)
        z3 = 0.0
        gathers, scatter = self.microbatch_dp_traffic(plan, params, gpu)
        if (gathers or scatter) and self.fsdp_measured(plan):
            # FSDP2's own per-unit work, measured (profile/fsdp_units.py): every unit (each block
            # and the chunk's root) pays the fit's per-call time once per call
            gathers, scatter = self.microbatch_dp_traffic(plan, params, gpu,
                                                          units=self.fsdp_units(start, stop))
        elif (gathers or scatter) and self.profile.collectives:
            # measured collectives: FSDP issues one call per unit (each block and the chunk's
            # root), so each unit pays the fitted per-call alpha, not the chunk once
            units = sum(1 for layer in self.model.layers[start:stop] if layer.kind == "block") + 1
            gathers, scatter = (units * x for x in self.microbatch_dp_traffic(
                plan, params / units, gpu))
        if gathers or scatter:
            ef, eb = self.zero_exposed(plan, gathers, scatter, f, b)
            f, b, bg, z3 = f + ef, b + eb, bg + eb, ef + eb
        return ChunkTime(f, b, bg, wg, comp, re, tpc, z3, params, cpc)

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

    def grad_sync_s(self, plan: Plan, reduce_s: float, window_s: float, grad_bytes: float, *,
                    last_bucket: bool = True) -> float:
        """Seconds the step's gradient reduction (``reduce_s``) adds after the last backward
        whose compute lasts ``window_s``. ``overlap_grad_reduce`` off: all of it. On: buckets
        reduce while the backward runs, up to ``dp_overlap`` of it and the window, but the last
        bucket (``grad_bucket_bytes`` of the ``grad_bytes`` reduced) waits for the last gradient; what hides
        slows the backward by ``overlap_slowdown``. ``last_bucket`` False leaves that floor out
        (a lower bound affine in ``reduce_s``, for the planner)."""
        if not plan.overlap_grad_reduce or reduce_s <= 0:
            return max(reduce_s, 0.0)
        floor = 0.0
        if last_bucket:
            floor = reduce_s * min(1.0, self.coef.grad_bucket_bytes / max(grad_bytes, 1.0))
        return comm.overlapped([(reduce_s, self.coef.dp_overlap)], window_s,
                               self.coef.overlap_slowdown, least_exposed_s=floor)

    def fsdp_measured(self, plan: Plan) -> bool:
        """Whether the Profile measured FSDP2's per-unit calls for this plan's dp group."""
        d = plan.grad_replicas
        return plan.zero >= 2 and d > 1 and \
            f"fsdp_all_gather/{d}" in self.profile.collectives and \
            f"fsdp_reduce_scatter/{d}" in self.profile.collectives

    def fsdp_units(self, start: int, stop: int) -> int:
        """FSDP2 units of a chunk of layers [start, stop): each block and the chunk's root."""
        return sum(1 for layer in self.model.layers[start:stop] if layer.kind == "block") + 1

    def fsdp_calls(self, kind: str, n: int, calls: float, nbytes: float, units: int) -> float:
        """Seconds of ``calls`` FSDP2 calls of ``kind`` over each of ``units`` units sharing
        ``nbytes`` (the Profile's ``fsdp_<kind>/n`` fit: linear, so an even split is exact)."""
        if calls <= 0 or nbytes <= 0:
            return 0.0
        return calls * units * (self.profile.collective_s(f"fsdp_{kind}", n, nbytes / units) or 0.0)

    def microbatch_dp_traffic(self, plan: Plan, params: float, gpu: GPUSpec,
                              units: int = 0) -> tuple[float, float]:
        """(all-gather, reduce-scatter) seconds of the data-parallel collectives inside one
        micro-batch over ``params`` (ZeRO-3's gathers in forward and backward, ZeRO-2/3's
        gradient reduce-scatter; none under pipeline parallelism, see cost/state.py). ``units``
        > 0 prices them as that many FSDP2 units from the Profile's measured per-unit fits.
        The group is dp x cp (``Plan.grad_replicas``: context-parallel ranks hold the same
        parameters)."""
        d = plan.grad_replicas
        traffic = data_parallel_traffic(zero=plan.zero, dp=d, pp=plan.pp, dtype=plan.dtype,
                                        reduce_dtype=plan.reduce_dtype)
        if d == 1:
            return 0.0, 0.0
        if units > 0:
            c = gather_bytes_per_param(plan.dtype)
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

    def rank_memory(self, plan: Plan, pp_rank: int, chunks: Sequence[tuple[int, int, Sequence[Recompute]]],
                    gpu: GPUSpec) -> StageMemory:
        """Peak memory of one rank of pipeline rank ``pp_rank`` holding ``chunks``, added up from
        ``rank_memory_terms`` (cost/rank_terms.py), the terms the planner's bounds read."""
        coster = self.coster(plan.dtype, plan.cp)
        held = self.held(plan)
        terms = rank_memory_terms(self, plan, pp_rank, gpu)
        params = stored = working = biggest = 0.0
        # a tied head in a chunk of its own (the V's rank 0 holds chunks 0 and 2pp - 1) is a
        # second parameter the runtime holds, reduces and updates (run/engine/train_engine.py sums the two
        # gradients); chunk_params drops it only where one chunk holds both ends
        for start, stop, recompute in chunks:
            params += self.chunk_params(start, stop, plan.tp)
            for offset, index in enumerate(range(start, stop)):
                cost = coster.layer(index, gpu, plan.micro_batch, plan.tp, plan.sequence_parallel,
                                    recompute[offset])
                stored += cost.activation_bytes
                working = max(working, cost.working_bytes)
                biggest = max(biggest, self.chunk_params(index, index + 1, plan.tp))
        # ZeRO as the runtime realises it (cost/state.py): fp32 masters, gradients and moments;
        # ZeRO-3 gathers its largest layer plus a prefetch; transient unsharded copies and whole
        # gradients between micro-batches (held.peak_extra)
        return StageMemory(params=params * (held.params + terms.weight_copy_bytes_per_param),
                           grads=params * held.grads,
                           optimizer=params * held.optimizer,
                           activations=terms.activation_bytes(stored, working),
                           buffers=biggest * terms.gather_bytes_per_param + params * held.peak_extra,
                           reserved=terms.reserved_bytes, in_flight_microbatches=terms.in_flight)

    def rank_tail(self, plan: Plan, params: float, last_bwd_s: float, gpu: GPUSpec,
                  units: int = 1, least: bool = False) -> tuple[float, float]:
        """(exposed data-parallel gradient sync, optimizer step) after a rank's last backward;
        ``units``: the rank's FSDP2 units (priced per unit where the Profile measured them);
        ``least``: without the last bucket's floor (``grad_sync_s``), for the planner's bounds.
        Gradients are reduced over dp x cp (``Plan.grad_replicas``)."""
        d = plan.grad_replicas
        traffic = data_parallel_traffic(zero=plan.zero, dp=d, pp=plan.pp, dtype=plan.dtype,
                                        reduce_dtype=plan.reduce_dtype)
        link = self.group_link(gpu, plan.tp * d)
        # gradient reductions overlap the last backward; parameter gathers (ZeRO-1 after the
        # update, ZeRO-2 before the first forward) do not
        reduce = self.collective("all_reduce", d, params * traffic.all_reduce_per_step, link)
        if self.fsdp_measured(plan):  # ZeRO-2/3: FSDP2's per-step gathers and reduce-scatters
            reduce += self.fsdp_calls("reduce_scatter", d, 1.0,
                                      params * traffic.reduce_scatter_per_step, units)
            gather = self.fsdp_calls("all_gather", d, 1.0,
                                     params * traffic.all_gather_per_step * d, units)
        else:
            reduce += self.collective("reduce_scatter", d,
                                      params * traffic.reduce_scatter_per_step, link)
            gather = self.collective("all_gather", d,
                                     params * traffic.all_gather_per_step * d, link)
        grad_bytes = params * (traffic.all_reduce_per_step + traffic.reduce_scatter_per_step)
        exposed = self.grad_sync_s(plan, reduce, last_bwd_s, grad_bytes,
                                   last_bucket=not least) + gather
        if self.profile.collectives:  # the step's two scalar all-reduces (loss, gradient norm)
            exposed += 2 * (self.profile.collective_s("all_reduce", plan.world_size, 8.0) or 0.0)
        shard = d if plan.zero >= 1 else 1
        optimizer = params / shard * self.coef.optimizer_bytes_per_param / (gpu.hbm_gbps * 1e9)
        if self.profile.optimizer_s_per_param > 0:  # measured: fixed + per-parameter tail
            optimizer = self.profile.optimizer_fixed_s + params / shard * self.profile.optimizer_s_per_param
        return exposed, optimizer

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
        nbytes = plan.micro_batch * self.model.seq_len * self.model.hidden_size * \
            self.model.dtype_bytes * (2 if plan.dtype == "fp32" else 1) / plan.tp / plan.cp
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
        if plan.zero >= 2 and plan.grad_replicas > 1:  # FSDP2 shards over dp x cp
            grads /= plan.grad_replicas
        nbytes = grads * (4.0 if plan.reduce_dtype == "fp32" else 2.0)
        return self.collective("all_reduce", 2, nbytes, self.group_link(gpu, plan.world_size))

    # --- the whole plan ------------------------------------------------------------------------
    def estimate(self, plan: Plan) -> Estimate:
        model = self.model.with_seq_len(plan.seq_len)
        if model is not self.model:
            return CostModel(model, self.cluster, self.coef, self.profile).estimate(plan)
        plan.check_against(model)
        gpus = [self.stage_gpu(stage) for stage in plan.stages]
        times = [self.chunk_time(plan, s.start, s.stop, s.recompute, g)
                 for s, g in zip(plan.stages, gpus, strict=True)]
        return self.assemble(plan, gpus, times)

    def assemble(self, plan: Plan, gpus: Sequence[GPUSpec], times: Sequence[ChunkTime]) -> Estimate:
        p, m, v = plan.pp, plan.num_microbatches, plan.vpp
        zb = plan.schedule.split_backward  # input and weight gradients apart
        p2p = tuple(self.p2p_time(plan, g) for g in gpus)
        fwd = tuple(t.fwd_s for t in times)
        bwd = tuple(t.bgrad_s if zb else t.bwd_s for t in times)
        wgrad = tuple(t.wgrad_s for t in times) if zb else None
        # plans that differ only in what the simulation does not see (ZeRO 0/1/2, the tail)
        # share one simulation
        # asynchronous plans step every stage's optimizer after each backward, inside the
        # simulated steady state (cost/pipeline.async_steady_step), not once in the tail
        steps = tuple(self.rank_tail(plan, sum(times[c].params for c in plan.chunks_of(k)),
                                     0.0, gpus[k])[1] for k in range(p)) \
            if plan.schedule == Schedule.ASYNC else None
        key = (plan.schedule, p, m, v, fwd, bwd, wgrad, p2p, steps)
        timeline = self._timelines.get(key)
        if timeline is None:
            if len(self._timelines) > 50_000:
                self._timelines.clear()
            timeline = self._timelines[key] = simulate(plan.schedule, p, m, fwd, bwd, v=v,
                                                       wgrad_s=wgrad, p2p_s=p2p) \
                if steps is None else async_steady_step(p, m, fwd, bwd, p2p_s=p2p, step_s=steps)
        memory, ends, tails, tied_syncs = [], [], [], []
        for k in range(p):
            chunk_ids = plan.chunks_of(k)
            gpu = gpus[chunk_ids[0]]
            chunks = [(plan.stages[c].start, plan.stages[c].stop, plan.stages[c].recompute)
                      for c in chunk_ids]
            memory.append(self.rank_memory(plan, k, chunks, gpu))
            params = sum(times[c].params for c in chunk_ids)
            # the overlap window is the last backward's compute, recompute excluded, so that more
            # recompute never shortens the step (the planner's per-stage choice relies on it)
            units = sum(self.fsdp_units(plan.stages[c].start, plan.stages[c].stop) for c in chunk_ids)
            sync, opt = self.rank_tail(plan, params, tail_overlap_window_s(times[chunk_ids[0]]), gpu,
                                       units=units)
            tied = self.tied_embedding_sync_s(plan, k, gpu)
            tied_syncs.append(tied)
            sync += tied
            if steps is not None:  # m optimizer steps, already inside the simulated window
                opt = m * steps[k]
                tails.append((sync, opt))
                ends.append(timeline.rank_end_s[k] + sync)
                continue
            tails.append((sync, opt))
            ends.append(timeline.rank_end_s[k] + sync + opt)
        step = max(ends)
        crit = ends.index(step)
        crit_chunks = plan.chunks_of(crit)
        per_mb = {name: sum(getattr(times[c], name) for c in crit_chunks) * m
                  for name in ("compute_s", "recompute_s", "tp_comm_s", "zero3_comm_s")}
        breakdown = {
            "compute": per_mb["compute_s"],
            "recompute": per_mb["recompute_s"],
            "tp_comm": per_mb["tp_comm_s"],
            "zero3_comm_exposed": per_mb["zero3_comm_s"],
            "pp_bubble": timeline.rank_end_s[crit] - timeline.rank_busy_s[crit],
            "dp_comm_exposed": tails[crit][0] - tied_syncs[crit],
            "embedding_sync": tied_syncs[crit],
            "optimizer": tails[crit][1],
        }
        if plan.cp > 1:  # the ring's K/V exchange beyond each step's attention block
            breakdown["cp_comm_exposed"] = sum(times[c].cp_comm_s for c in crit_chunks) * m
        tokens = plan.global_batch * plan.seq_len
        model_flops = tokens * self.model.model_flops_per_token()
        hw_flops = tokens * sum(
            3 * layer.fwd_flops_per_token + layer.recompute_flops_per_token.get(mode, 0.0)
            for layer, mode in zip(self.model.layers, plan.recompute_of_layer(), strict=True)
        )
        world = plan.world_size
        # every pipeline rank's tp x dp GPUs share the GPU type of its first chunk
        peak = sum(gpus[plan.chunks_of(k)[0]].peak_flops(plan.dtype) for k in range(p)) * world / p
        return Estimate(
            step_time_s=step,
            tokens_per_s=tokens / step,
            tflops_per_gpu=hw_flops / step / world / 1e12,
            model_tflops_per_gpu=model_flops / step / world / 1e12,
            mfu=model_flops / step / peak,
            bubble_fraction=timeline.bubble_fraction,
            memory=tuple(memory),
            memory_budget_bytes=tuple(gpus[plan.chunks_of(k)[0]].memory_bytes for k in range(p)),
            breakdown_s=breakdown,
            stage_times_s=tuple((t.fwd_s, t.bwd_s) for t in times),
        )
