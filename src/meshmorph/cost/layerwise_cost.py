"""Time and memory of a stage whose layers each use their own tp/dp/ZeRO (layerwise plans).

Every per-layer figure comes from the cost model's own pieces, called with the layer's
strategy: ``LayerCoster.layer`` (compute, TP communication, activations) with the layer's tp and
its per-rank micro-batch B / dp_layer (B = plan dp x micro_batch sequences per stage
micro-batch), ``CostModel.microbatch_dp_traffic`` and ``CostModel.rank_tail`` (ZeRO traffic,
gradient reduction and optimizer step of the layer's parameters over its own data-parallel
group) and ``rank_memory_terms`` (bytes per parameter held, micro-batches in flight, ZeRO-3
gather buffers). Transitions between neighbouring layers come from cost/transition.py.

A stage then costs, per step (m micro-batches):

    time   = m x sum_i (f_i + b_i + transition_i) + sum_i tail_i
    memory = sum_i params_i x held_i + in_flight x sum_i a_i + max_i w_i + max_i g_i + reserved

where each layer's per-micro-batch ZeRO traffic and its gradient sync are exposed against that
layer's own compute (``comm.exposed``; the uniform ``CostModel`` exposes a whole chunk's against
the chunk's, so a uniform layerwise plan with dp > 1 is priced within a few per cent of it, never
the same to the last digit; with dp = 1 the two agree).

The two ends carry what ``CostModel`` adds per rank, from its own functions called with the end
layer's strategy: a tied embedding's gradient all-reduce between the ranks holding the
embedding and the head (``CostModel.tied_embedding_sync_s``) is in the tail of the first layer
on its rank and of the last layer on its, and the head's loss buffers
(``rank_terms.head_loss_bytes``) are in the last layer's memory. The tied matrix is counted
once only where one chunk holds both ends (``CostModel.chunk_params``): the V's rank 0 holds
the embedding and the head in two chunks, two parameters.

Sequence parallelism (the plan's flag) applies to every layer at tp > 1: its activations are
split along the sequence (``LayerCoster.layer`` with sp), and the transitions become all-to-alls
(cost/transition.py). The zero-bubble schedule (ZB-H1) splits each chunk's backward into the
input gradient (B: recompute, exposed communication and backward transitions included) and the
weight gradient (W: ``LayerCost.wgrad_s``), as ``CostModel.assemble`` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from meshmorph.cost.estimate import Estimate, StageMemory
from meshmorph.cost.pipeline import simulate
from meshmorph.cost.rank_terms import RankMemoryTerms, head_loss_bytes, rank_memory_terms
from meshmorph.cost.transition import transition
from meshmorph.schedule.table import Schedule
from meshmorph.spec.gpus import GPUSpec
from meshmorph.spec.model import Recompute
from meshmorph.spec.plan import LayerStrategy, Plan, PlanError

if TYPE_CHECKING:
    from meshmorph.cost.model import CostModel


@dataclass(frozen=True, slots=True)
class LayerTerms:
    """One layer under one strategy and recompute mode, on one rank of its stage."""

    fwd_s: float
    """Forward per micro-batch, exposed TP and ZeRO-3 communication included."""
    bwd_s: float
    """Backward per micro-batch, recompute and exposed communication included."""
    wgrad_s: float
    """The weight-gradient part of bwd_s (the zero-bubble W op)."""
    compute_s: float
    """Forward + backward compute, no recompute or communication."""
    tail_s: float
    """Exposed gradient sync + parameter gathers + optimizer step of its parameters, per step;
    at an end of a pipeline split between ranks, the tied embedding's all-reduce too."""
    param_bytes: float
    """Parameters x bytes held per parameter at the peak (masters, grads, moments, copies)."""
    loss_bytes: float
    """The head's loss buffers on its rank (``head_loss_bytes``); 0 for other layers."""
    stored_bytes: float
    """Activation bytes kept per micro-batch."""
    working_bytes: float
    """Extra bytes while its backward rematerialises activations."""
    gather_bytes: float
    """ZeRO-3 gather buffers (the layer plus a prefetch) while it runs."""
    params: float
    """Parameters on one tensor-parallel rank."""


def layer_plan(plan: Plan, strategy: LayerStrategy) -> Plan:
    """The uniform plan a layer under ``strategy`` sees: the plan's devices, schedule and
    micro-batch count, the layer's tp, dp, ZeRO and its per-rank micro-batch."""
    sequences = plan.dp * plan.micro_batch
    if sequences % strategy.dp:
        raise PlanError(f"layer dp {strategy.dp} does not divide the stage's {sequences} sequences "
                        "per micro-batch; choose a dp that divides them")
    micro = sequences // strategy.dp
    return replace(plan, tp=strategy.tp, dp=strategy.dp, zero=strategy.zero, micro_batch=micro,
                   global_batch=strategy.dp * micro * plan.num_microbatches,
                   sequence_parallel=plan.sequence_parallel and strategy.tp > 1, stages=())


@dataclass(frozen=True, slots=True)
class LayerTimes:
    """The part of ``LayerTerms`` that does not depend on the pipeline rank holding the layer."""

    sub: Plan
    """The uniform plan the layer sees (``layer_plan``)."""
    fwd_s: float
    """Forward per micro-batch, exposed TP and ZeRO-3 communication included."""
    bwd_s: float
    """Backward per micro-batch, recompute and exposed communication included."""
    wgrad_s: float
    """The weight-gradient part of bwd_s."""
    compute_s: float
    """Forward + backward compute."""
    tail_s: float
    """Exposed gradient sync + parameter gathers + optimizer step, per step; at an end of a
    pipeline split between ranks, the tied embedding's all-reduce too
    (``CostModel.tied_embedding_sync_s``)."""
    loss_bytes: float
    """The head's loss buffers on its rank (``head_loss_bytes``); 0 for other layers."""
    stored_bytes: float
    """Activation bytes of one micro-batch."""
    working_bytes: float
    """Extra bytes while its backward rematerialises activations."""
    params: float
    """Parameters on one tensor-parallel rank."""


def layer_times(cost: CostModel, plan: Plan, index: int, strategy: LayerStrategy,
                recompute: Recompute, gpu: GPUSpec, *, drop_tied: bool = False,
                sub: Plan | None = None) -> LayerTimes:
    """The rank-independent terms of layer ``index`` (``layer_terms``); ``sub``: its
    ``layer_plan(plan, strategy)`` when already made."""
    sub = layer_plan(plan, strategy) if sub is None else sub
    cost_ = cost.coster(plan.dtype).layer(index, gpu, sub.micro_batch, strategy.tp,
                                          sub.sequence_parallel, recompute)
    params = cost.chunk_params(index, index + 1, strategy.tp)
    if drop_tied:
        params -= cost.model.layers[index].tied_params / strategy.tp
    f, b = cost_.fwd_s, cost_.bwd_s
    gathers, scatter = cost.microbatch_dp_traffic(sub, params, gpu)
    if gathers or scatter:  # as CostModel.chunk_time, against this layer's compute
        ef, eb = cost.zero_exposed(sub, gathers, scatter, cost_.fwd_s, cost_.bwd_s)
        f, b = f + ef, b + eb
    sync, optimizer = cost.rank_tail(sub, params, cost_.compute_s * 2 / 3, gpu)
    last = cost.model.num_layers - 1
    head_rank = sub.pp_rank_of_chunk(sub.num_chunks - 1)
    if index in (0, last):  # 0 unless tied and the ends are on two ranks
        sync += cost.tied_embedding_sync_s(sub, 0 if index == 0 else head_rank, gpu)
    loss = head_loss_bytes(cost, sub, head_rank) if index == last else 0.0
    return LayerTimes(sub=sub, fwd_s=f, bwd_s=b, wgrad_s=cost_.wgrad_s,
                      compute_s=cost_.compute_s, tail_s=sync + optimizer, loss_bytes=loss,
                      stored_bytes=cost_.activation_bytes, working_bytes=cost_.working_bytes,
                      params=params)


def terms_on_rank(times: LayerTimes, terms: RankMemoryTerms) -> LayerTerms:
    """``LayerTerms`` of a layer with rank-independent ``times`` on a rank whose memory
    coefficients are ``terms`` (``rank_memory_terms`` of ``times.sub`` there)."""
    return LayerTerms(fwd_s=times.fwd_s, bwd_s=times.bwd_s, wgrad_s=times.wgrad_s,
                      compute_s=times.compute_s, tail_s=times.tail_s,
                      param_bytes=times.params * terms.bytes_per_param,
                      loss_bytes=times.loss_bytes,
                      stored_bytes=times.stored_bytes * terms.in_flight,
                      working_bytes=times.working_bytes,
                      gather_bytes=times.params * terms.gather_bytes_per_param,
                      params=times.params)


def layer_terms(cost: CostModel, plan: Plan, pp_rank: int, index: int, strategy: LayerStrategy,
                recompute: Recompute, gpu: GPUSpec, *, drop_tied: bool = False) -> LayerTerms:
    """The terms of layer ``index`` (module docstring); ``drop_tied``: the head's chunk also
    holds the tied embedding, so the head's tied weights are not counted twice."""
    times = layer_times(cost, plan, index, strategy, recompute, gpu, drop_tied=drop_tied)
    return terms_on_rank(times, rank_memory_terms(cost, times.sub, pp_rank, gpu))


def reserved_bytes(cost: CostModel, gpu: GPUSpec) -> float:
    """CUDA context and allocator reserve of one rank (as ``rank_memory_terms``)."""
    return cost.coef.context_bytes + cost.coef.memory_reserve_fraction * gpu.memory_bytes


@dataclass(frozen=True, slots=True)
class StageCost:
    """A whole stage under a per-layer assignment."""

    fwd_s: float
    """Forward per micro-batch, transitions included."""
    bwd_s: float
    """Backward per micro-batch, transitions included."""
    tail_s: float
    """Sum of the layers' tails."""
    memory_bytes: float
    """Peak bytes of one rank."""
    transition_s: float
    """Forward + backward redistribution per micro-batch."""

    def busy_s(self, num_microbatches: int) -> float:
        """The stage's own step time: m (f + b) + tail (the step itself when pp = 1)."""
        return num_microbatches * (self.fwd_s + self.bwd_s) + self.tail_s


@dataclass(frozen=True, slots=True)
class RankCost:
    """One pipeline rank holding one or more chunks (interleaved: ``vpp`` of them)."""

    fwd_s: tuple[float, ...]
    """Forward per micro-batch of each chunk, transitions included."""
    bwd_s: tuple[float, ...]
    """Backward per micro-batch of each chunk, transitions included."""
    wgrad_s: tuple[float, ...]
    """The weight-gradient part of each chunk's backward (zero-bubble W)."""
    tail_s: float
    """Sum of the rank's layers' tails."""
    memory_bytes: float
    """Peak bytes of the rank."""
    transition_s: float
    """Forward + backward redistribution per micro-batch over all its chunks."""


LAYERWISE_SCHEDULES = (Schedule.ONE_F_ONE_B, Schedule.GPIPE, Schedule.INTERLEAVED,
                       Schedule.ZERO_BUBBLE, Schedule.ZBV, Schedule.DUALPIPEV)
"""Schedules a layerwise plan may use (asynchronous 1F1B is not offered)."""

Chunk = tuple[int, int, Sequence[LayerStrategy], Sequence[Recompute]]
"""(start, stop, strategy of each layer, recompute of each layer)."""


def rank_cost(cost: CostModel, plan: Plan, pp_rank: int, chunks: Sequence[Chunk],
              gpu: GPUSpec) -> RankCost:
    """Time and memory of a rank holding ``chunks`` (module docstring); no transition between
    two chunks (the pipeline's send carries the activation)."""
    # one chunk holding both tied ends holds one matrix (CostModel.chunk_params)
    tied = any(start == 0 and stop == cost.model.num_layers for start, stop, _, _ in chunks)
    fwd, bwd, wgrad = [], [], []
    tail = params = stored = working = gather = moved = 0.0
    for start, stop, strategies, recompute in chunks:
        f = b = w = 0.0
        for offset, index in enumerate(range(start, stop)):
            t = layer_terms(cost, plan, pp_rank, index, strategies[offset], recompute[offset],
                            gpu, drop_tied=tied and index == cost.model.num_layers - 1)
            f, b, w, tail = f + t.fwd_s, b + t.bwd_s, w + t.wgrad_s, tail + t.tail_s
            params += t.param_bytes + t.loss_bytes
            stored += t.stored_bytes
            working, gather = max(working, t.working_bytes), max(gather, t.gather_bytes)
            if offset:
                step = transition(cost, strategies[offset - 1], strategies[offset],
                                  plan.dp * plan.micro_batch, plan.dtype, gpu,
                                  sequence_parallel=plan.sequence_parallel)
                f, b, moved = f + step.fwd_s, b + step.bwd_s, moved + step.fwd_s + step.bwd_s
        fwd.append(f)
        bwd.append(b)
        wgrad.append(w)
    memory = params + stored + working + gather + reserved_bytes(cost, gpu)
    return RankCost(tuple(fwd), tuple(bwd), tuple(wgrad), tail, memory, moved)


def stage_cost(cost: CostModel, plan: Plan, pp_rank: int, start: int, stop: int,
               strategies: Sequence[LayerStrategy], recompute: Sequence[Recompute],
               gpu: GPUSpec) -> StageCost:
    """Time and memory of a rank holding layers [start, stop) under ``strategies``."""
    r = rank_cost(cost, plan, pp_rank, [(start, stop, strategies, recompute)], gpu)
    return StageCost(r.fwd_s[0], r.bwd_s[0], r.tail_s, r.memory_bytes, r.transition_s)


def stage_strategies(plan: Plan, index: int) -> tuple[LayerStrategy, ...]:
    """The layer strategies of stage ``index`` (the plan's own where the stage lists none)."""
    stage = plan.stages[index]
    if stage.layer_strategies is not None:
        return stage.layer_strategies
    return (LayerStrategy(tp=plan.tp, dp=plan.dp, zero=plan.zero),) * stage.num_layers


def estimate_layerwise(cost: CostModel, plan: Plan) -> Estimate:
    """Step time and memory of a plan whose stages list layer strategies: the schedule simulated
    over the chunks' layerwise times, each rank's step ending with its layers' tails."""
    if plan.schedule not in LAYERWISE_SCHEDULES:
        raise PlanError(f"layerwise plans run {', '.join(LAYERWISE_SCHEDULES)}, not "
                        f"{plan.schedule}; drop layer_strategies or change the schedule")
    plan.check_against(cost.model)
    gpus = [cost.stage_gpu(stage) for stage in plan.stages]
    m, p = plan.num_microbatches, plan.pp
    ranks = []
    for k in range(p):
        ids = plan.chunks_of(k)
        ranks.append(rank_cost(cost, plan, k, [
            (plan.stages[c].start, plan.stages[c].stop, stage_strategies(plan, c),
             plan.stages[c].recompute) for c in ids], gpus[ids[0]]))
    zb = plan.schedule.split_backward  # input and weight gradients apart
    fwd, bwd, wgrad = ([0.0] * plan.num_chunks for _ in range(3))
    for k, r in enumerate(ranks):
        for c, f, b, w in zip(plan.chunks_of(k), r.fwd_s, r.bwd_s, r.wgrad_s, strict=True):
            fwd[c], bwd[c], wgrad[c] = f, b - w if zb else b, w
    p2p = tuple(cost.p2p_time(plan, g) for g in gpus)
    timeline = simulate(plan.schedule, p, m, fwd, bwd, v=plan.vpp, p2p_s=p2p,
                        wgrad_s=wgrad if zb else None)
    ends = [timeline.rank_end_s[k] + ranks[k].tail_s for k in range(p)]
    step = max(ends)
    last = ends.index(step)
    crit = ranks[last]
    tokens = plan.global_batch * plan.seq_len
    model_flops = tokens * cost.model.model_flops_per_token()
    hw_flops = tokens * sum(
        3 * layer.fwd_flops_per_token + layer.recompute_flops_per_token.get(mode, 0.0)
        for layer, mode in zip(cost.model.layers, plan.recompute_of_layer(), strict=True))
    world = plan.world_size
    rank_gpus = [gpus[plan.chunks_of(k)[0]] for k in range(p)]
    peak = sum(g.peak_flops(plan.dtype) for g in rank_gpus) * world / p
    memory = tuple(StageMemory(params=0.0, grads=0.0, optimizer=0.0, activations=0.0, buffers=0.0,
                               reserved=r.memory_bytes, in_flight_microbatches=0.0)
                   for r in ranks)
    return Estimate(
        step_time_s=step, tokens_per_s=tokens / step,
        tflops_per_gpu=hw_flops / step / world / 1e12,
        model_tflops_per_gpu=model_flops / step / world / 1e12,
        mfu=model_flops / step / peak, bubble_fraction=timeline.bubble_fraction,
        memory=memory, memory_budget_bytes=tuple(g.memory_bytes for g in rank_gpus),
        breakdown_s={  # of the rank that ends last
            "layers": m * (sum(crit.fwd_s) + sum(crit.bwd_s) - crit.transition_s),
            "transitions": m * crit.transition_s,
            "pp_bubble": timeline.rank_end_s[last] - timeline.rank_busy_s[last],
            "dp_sync_and_optimizer": crit.tail_s},
        stage_times_s=tuple((f, b + w if zb else b) for f, b, w in zip(fwd, bwd, wgrad,
                                                                        strict=True)))
