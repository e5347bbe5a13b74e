"""The search space of the planner: every layout it considers, as plain configurations.

A configuration fixes everything but the stage boundaries and per-layer recompute: tp (inside a
node, dividing heads and FFN), cp (context parallel, for long sequences: ``cp_degrees``), pp,
dp = world / (tp * cp * pp) dividing the batch, ZeRO stage,
sequence parallel, micro-batch size (at most ``max_microbatches`` micro-batches per step),
schedule (GPipe, 1F1B, ZB-H1; ZBV and DualPipeV with two chunks per rank in a V; interleaved
with v chunks when the blocks fill pp * v chunks (evenly where they divide, else in the
uneven splits of ``plan.partition_search.interleaved_block_counts``); asynchronous 1F1B only
when asked) and, on mixed clusters, which GPU type each
pipeline rank uses (groups stay contiguous; every order of the groups is tried).

With ``SearchOptions.layerwise`` a second space is searched (``layer_configurations``): each
layer of a stage chooses its own tp, dp and ZeRO stage (Galvatron-BMW's idea). A configuration
then fixes pp (one GPU type), the sequences B of a stage micro-batch (m = batch / B), sequence
parallelism and the schedule (the interleaved and V schedules with even chunks), and offers its
layers every split of the stage's D = world / pp devices D = tp x dp with tp inside a node and
dividing the heads, dp dividing B and B / dp at most ``max_micro_batch``, under every ZeRO stage
of the options (``Config.strategies``). By default only plans the runtime runs
(spec/runnable.py): the schedules a layerwise pipeline runs, a tied embedding and head under one
(tp, ZeRO) pair (``Config.ends``), and no fp16.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import permutations

from meshmorph.schedule.table import Schedule
from meshmorph.spec.cluster import Cluster
from meshmorph.spec.model import ModelSpec, Recompute
from meshmorph.spec.plan import DType, Fp8Scaling, LayerStrategy, Plan, WeightPrediction
from meshmorph.spec.runnable import runnable_shape_refusal, tied_ends_refusal, zero_runs_under


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchOptions:
    """Limits of the search space."""

    top_k: int = 5
    """How many plans to return (the best configurations, each with its best stages)."""
    dtype: DType = DType.BF16
    """Compute dtype of every plan (``bf16``, ``fp16``, ``fp32`` or ``fp8``; a string is
    converted)."""
    fp8_scaling: Fp8Scaling = Fp8Scaling.TENSORWISE
    """With dtype ``fp8``: every plan's ``Plan.fp8_scaling``."""
    max_micro_batch: int = 16
    """Largest micro-batch size tried."""
    max_microbatches: int = 65_536
    """Most micro-batches per step a layout may have: the cost model simulates each one, so a
    layout beyond this is left out (and a batch that needs more on every layout is refused)."""
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    """ZeRO stages tried when dp > 1."""
    schedules: tuple[Schedule, ...] = tuple(s for s in Schedule if s != Schedule.ASYNC)
    """Pipeline schedules tried when pp > 1 (``async`` only when listed here or with
    ``allow_async``)."""
    max_vpp: int = 4
    """Most virtual stages per pipeline rank for the interleaved schedule."""
    sequence_parallel: tuple[bool, ...] = (False, True)
    """Sequence-parallel settings tried when tp > 1."""
    recompute: tuple[Recompute, ...] = tuple(Recompute)
    """Recompute modes a layer may use."""
    tolerance: float = 1e-3
    """Optimality gap: branches whose lower bound is within this fraction of the best step found
    are cut, so the result is at most this much slower than the optimum (0 = exact; near-ties
    between pipeline partitions make exact search slow on deep pipelines)."""
    max_nodes: int | None = 1000
    """Branch-and-bound nodes per configuration before its open branches are left with their
    bound (the result then reports its proven optimality gap); None: search to the end."""
    tp_degrees: tuple[int, ...] | None = None
    """Only these tensor-parallel degrees (None: all that fit a node and divide the model)."""
    pp_degrees: tuple[int, ...] | None = None
    """Only these pipeline degrees (None: all)."""
    allow_async: bool = False
    """Also offer schedule ``async`` (1F1B without flush, PipeDream: no flush bubble, stale
    weights, so not the same math as one device) though ``schedules`` does not list it."""
    cp_min_seq_len: int = 16_384
    """Context-parallel degrees are searched only for sequences at least this long. Below it
    (Llama 3 pretrained its 8K stage without CP and used CP 16 for 128K; Megatron-Core presents
    CP for long context) one sequence's activations fit beside tp and recompute, and the ring
    only adds traffic; skipping cp there keeps the search as small as it was."""
    cp_max: int | None = None
    """Largest context-parallel degree tried (None: up to what the world allows)."""
    fsdp_prefetch: tuple[bool, ...] = (True, False)
    """``Plan.fsdp_prefetch`` settings tried where they trade memory for time (ZeRO-3 gathering
    per micro-batch without a pipeline: prefetch holds one more gathered unit and hides the
    gathers); elsewhere prefetch costs no memory and is never slower, so only on is tried
    (off if only off is listed)."""
    tp_comm_overlap: tuple[bool, ...] = (False,)
    """``Plan.tp_comm_overlap`` settings tried for sequence-parallel layouts: (False, True) lets
    the planner weigh the hidden collectives against TransformerEngine's buffers (priced only:
    ``meshmorph run`` refuses the plans with it on)."""
    compile: bool = False
    """``Plan.compile`` of every plan: blocks under torch.compile, priced with fused kernels and
    fewer kept activations (not searched: it is the user's choice of how the run executes)."""
    overlap_grad_reduce: bool = True
    """``Plan.overlap_grad_reduce`` of every plan: on is never slower (what hides costs only
    ``overlap_slowdown`` of itself) and holds no more memory (DDP's buckets are the gradients,
    FSDP2 reduce-scatters into its own buffers either way), so it is not searched."""
    weight_prediction: WeightPrediction = WeightPrediction.NONE
    """Weights of the ``async`` plans (``none``, ``stash``, ``2bw``, ``sgd``, ``adam``): the
    stashed or predicted copies count against memory, so the planner leaves out the async
    layouts they do not fit."""
    layerwise: bool = False
    """Also search plans whose layers each choose their tp, dp and ZeRO stage
    (``layer_configurations``; one GPU type): the result is the faster of that space's best and
    the regular space's (``SearchResult.layerwise`` and ``.regular`` hold each)."""
    one_strategy_per_stage: bool = False
    """With ``layerwise``: the per-layer space restricted to one strategy per stage."""
    runnable_only: bool = True
    """With ``layerwise``: only plans meshmorph runs (spec/runnable.py); False also prices the
    per-layer plans the runtime does not run yet (the result says whether it runs)."""

    def __post_init__(self) -> None:
        if self.dtype not in tuple(DType):
            raise ValueError(f"dtype must be one of {', '.join(DType)}, got {self.dtype!r}")
        object.__setattr__(self, "dtype", DType(self.dtype))
        object.__setattr__(self, "fp8_scaling", Fp8Scaling(self.fp8_scaling))
        if self.top_k < 1:
            raise ValueError(f"top_k must be at least 1, got {self.top_k}")
        if Recompute.NONE not in self.recompute:
            raise ValueError("recompute options must include 'none' (layers that cannot "
                             "recompute, such as the embedding, use it)")
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"tolerance must be in [0, 1), got {self.tolerance}")
        if self.max_nodes is not None and self.max_nodes < 1:
            raise ValueError(f"max_nodes must be at least 1 (or None: no cap), got "
                             f"{self.max_nodes}")
        if self.max_micro_batch < 1:
            raise ValueError(f"max_micro_batch must be at least 1, got {self.max_micro_batch}")
        if self.allow_async and Schedule.ASYNC not in self.schedules:
            object.__setattr__(self, "schedules", (*self.schedules, Schedule.ASYNC))
        if self.cp_max is not None and self.cp_max < 1:
            raise ValueError(f"cp_max must be at least 1 (or None: no cap), got {self.cp_max}")
        if self.max_microbatches < 1:
            raise ValueError(f"max_microbatches must be at least 1, got {self.max_microbatches}")
        if self.weight_prediction not in tuple(WeightPrediction):
            raise ValueError(f"weight_prediction must be one of {', '.join(WeightPrediction)}, "
                             f"got {self.weight_prediction!r}")
        object.__setattr__(self, "weight_prediction", WeightPrediction(self.weight_prediction))


@dataclass(frozen=True, slots=True)
class Config:
    """One point of the search space, stages not yet chosen."""

    plan: Plan
    """The plan without stages (with even stages where the layers choose their strategies)."""
    rank_gpus: tuple[str, ...]
    """GPU type of each pipeline rank."""
    strategies: tuple[LayerStrategy, ...] | None = None
    """The strategies every layer may choose (the per-layer space), None: the plan's own."""
    ends: tuple[tuple[int, int], ...] | None = None
    """(tp, zero) pairs a tied embedding and head may share (one for both), None: any."""


def divisors(n: int, *, up_to: int | None = None) -> list[int]:
    """The divisors of ``n`` (at most ``up_to``), ascending. Pairs (d, n / d) with d <= sqrt(n):
    O(sqrt n) steps, or O(up_to) when only the small ones are wanted, so a huge batch whose
    micro-batch sizes are capped costs no more than a small one."""
    if n < 1:
        raise ValueError(f"divisors of {n}: n must be at least 1")
    limit = n if up_to is None else min(n, up_to)
    root = math.isqrt(n)
    if limit <= root:  # every wanted divisor is a small one
        return [d for d in range(1, limit + 1) if n % d == 0]
    small = [d for d in range(1, root + 1) if n % d == 0]
    large = [n // d for d in reversed(small) if n // d != d and n // d <= limit]
    return small + large


def tp_degrees(model: ModelSpec, cluster: Cluster, options: SearchOptions) -> list[int]:
    if not model.tp_splittable:
        return [1]
    return [tp for tp in divisors(cluster.gpus_per_node)
            if (options.tp_degrees is None or tp in options.tp_degrees)
            and not (model.num_heads % tp or model.num_kv_heads % tp or model.ffn_hidden_size % tp)]


def cp_degrees(model: ModelSpec, devices: int, options: SearchOptions) -> list[int]:
    """Context-parallel degrees for ``devices`` ranks per tp group: 1, and for sequences of at
    least ``options.cp_min_seq_len`` tokens every power of two dividing ``devices`` whose 2 cp
    equal chunks split the sequence (causal load balancing), up to ``options.cp_max``."""
    out = [1]
    if model.seq_len < options.cp_min_seq_len or model.arch == "custom":
        return out
    cp = 2
    while devices % cp == 0 and model.seq_len % (2 * cp) == 0 and (
            options.cp_max is None or cp <= options.cp_max):
        out.append(cp)
        cp *= 2
    return out


def prefetch_choices(zero: int, replicas: int, pp: int,
                     options: SearchOptions) -> tuple[bool, ...]:
    """``fsdp_prefetch`` settings worth trying for a plan of ZeRO stage ``zero`` over
    ``replicas`` (``Plan.grad_replicas``) on ``pp`` pipeline ranks
    (``SearchOptions.fsdp_prefetch``): both only where ZeRO-3 gathers without a pipeline."""
    if not options.fsdp_prefetch:
        raise ValueError("fsdp_prefetch options must list at least one setting")
    if zero == 3 and replicas > 1 and pp == 1:
        return options.fsdp_prefetch
    return (max(options.fsdp_prefetch),)


def zero_stages(options: SearchOptions, dp: int, pp: int) -> tuple[int, ...]:
    """ZeRO stages worth trying for a plan of ``dp`` replicas on ``pp`` pipeline ranks
    (``SearchOptions.zero_stages``): none without replicas; under a pipeline not ZeRO-2 beside
    ZeRO-1, which it prices and holds exactly as (torch pipelining reduce-scatters the whole
    gradients once per step either way, ``cost.state``), so it would only be solved twice and
    fill the top plans with twins."""
    if dp == 1:
        return (0,)
    if pp > 1 and 1 in options.zero_stages:
        return tuple(z for z in options.zero_stages if z != 2)
    return options.zero_stages


def rank_gpu_orders(cluster: Cluster, tp: int, dp: int, pp: int,
                    cp: int = 1) -> list[tuple[str, ...]]:
    """GPU type per pipeline rank: each group hosts (its GPUs) / (tp * cp * dp) ranks."""
    width = tp * cp * dp
    if any(group.num_gpus % width for group in cluster.groups):
        return []
    counts: dict[str, int] = {}
    for group in cluster.groups:
        counts[group.gpu.name] = counts.get(group.gpu.name, 0) + group.num_gpus // width
    if sum(counts.values()) != pp:
        return []
    orders = {tuple(name for name in order for _ in range(counts[name]))
              for order in permutations(counts)}
    return sorted(orders)


def configurations(model: ModelSpec, cluster: Cluster, global_batch: int,
                   options: SearchOptions) -> Iterator[Config]:
    """Every configuration of the search space."""
    world = cluster.world_size
    blocks = model.num_blocks
    for tp in tp_degrees(model, cluster, options):
        for cp in cp_degrees(model, world // tp, options) if world % tp == 0 else []:
            for pp in divisors(world // (tp * cp)):
                if options.pp_degrees is not None and pp not in options.pp_degrees:
                    continue
                if pp > model.num_layers:
                    continue
                dp = world // (tp * cp * pp)
                if global_batch % dp:
                    continue
                for gpus in rank_gpu_orders(cluster, tp, dp, pp, cp):
                    yield from _inner(model, global_batch, options, tp, pp, dp, gpus, blocks, cp)


def schedule_shapes(schedules: Iterable[Schedule], pp: int, m: int, blocks: int,
                    max_vpp: int, *, even_chunks: bool = False) -> list[tuple[Schedule, int]]:
    """(schedule, vpp) pairs a pipeline of ``pp`` ranks and ``m`` micro-batches may run, by the
    schedule table: its micro-batch rules, interleaved with 2 <= vpp <= ``max_vpp`` chunks per
    rank where the ``blocks`` fill pp x vpp chunks (``even_chunks``: split evenly), a V where
    they fill 2 pp. Without a pipeline, 1F1B alone."""
    if pp == 1:
        return [(Schedule.ONE_F_ONE_B, 1)]
    shapes: list[tuple[Schedule, int]] = []
    for schedule in schedules:  # what each runs with: the schedule table
        info = schedule.info
        if m < info.min_microbatches_per_pp * pp or (info.microbatches_multiple_of_pp and m % pp):
            continue
        if info.chunks_per_rank is None:  # interleaved: vpp is the search's to choose
            shapes.extend((schedule, v) for v in range(2, max_vpp + 1) if pp * v <= blocks
                          and (not even_chunks or blocks % (pp * v) == 0))
        elif info.chunks_per_rank == 1 or pp * info.chunks_per_rank <= blocks:
            shapes.append((schedule, info.chunks_per_rank))  # (a V needs 2pp blocks)
    return shapes


def _inner(model: ModelSpec, global_batch: int, options: SearchOptions, tp: int, pp: int, dp: int,
           gpus: tuple[str, ...], blocks: int, cp: int = 1) -> Iterator[Config]:
    per_rank = global_batch // dp
    for b in divisors(per_rank, up_to=options.max_micro_batch):
        m = per_rank // b
        if m > options.max_microbatches:
            continue
        schedules = schedule_shapes(options.schedules, pp, m, blocks, options.max_vpp)
        for zero in zero_stages(options, dp, pp):
            for sp in options.sequence_parallel if tp > 1 else (False,):
                if sp and (model.seq_len // cp) % tp:
                    continue
                for schedule, vpp in schedules:
                    if not zero_runs_under(schedule, zero, dp):
                        continue  # torch's zero-bubble pipelining loses ZeRO-3's gradients
                    for prefetch in prefetch_choices(zero, dp * cp, pp, options):
                        for tpo in options.tp_comm_overlap if sp else (False,):
                            yield Config(Plan(
                                model=model.name, seq_len=model.seq_len,
                                global_batch=global_batch, tp=tp, pp=pp, dp=dp, cp=cp, zero=zero,
                                micro_batch=b, num_microbatches=m, schedule=schedule, vpp=vpp,
                                sequence_parallel=sp, dtype=options.dtype,
                                weight_prediction=options.weight_prediction
                                if schedule == Schedule.ASYNC else "none",
                                overlap_grad_reduce=options.overlap_grad_reduce,
                                compile=options.compile, fp8_scaling=options.fp8_scaling,
                                fsdp_prefetch=prefetch, tp_comm_overlap=tpo), gpus)


def layer_strategies(model: ModelSpec, cluster: Cluster, options: SearchOptions, devices: int,
                     sequences: int, schedule: Schedule, *,
                     sequence_parallel: bool = False) -> list[LayerStrategy]:
    """The strategies a layer of a stage of ``devices`` devices and ``sequences`` sequences per
    micro-batch may take (module docstring) under ``schedule``."""
    out = []
    for tp in tp_degrees(model, cluster, options):
        dp = devices // tp
        if (devices % tp or sequences % dp or sequences // dp > options.max_micro_batch
                or (sequence_parallel and model.seq_len % tp)):
            continue
        out.extend(LayerStrategy(tp=tp, dp=dp, zero=z)
                   for z in (options.zero_stages if dp > 1 else (0,))
                   if zero_runs_under(schedule, z, dp))
    return out


def layer_configurations(model: ModelSpec, cluster: Cluster, global_batch: int,
                         options: SearchOptions) -> Iterator[Config]:
    """Every configuration of the per-layer space (module docstring)."""
    world, blocks = cluster.world_size, model.num_blocks
    # one chunk per rank first, then interleaved, then the V: the order of the table's rows
    order = sorted(options.schedules, key=lambda s: {1: 0, None: 1}.get(
        s.info.chunks_per_rank, 2))
    for pp in divisors(world):
        if pp > blocks or (options.pp_degrees and pp not in options.pp_degrees):
            continue
        for sequences in divisors(global_batch):
            m = global_batch // sequences
            if m > options.max_microbatches:
                continue
            shapes = [shape for shape in schedule_shapes(order, pp, m, blocks, options.max_vpp,
                                                         even_chunks=True)
                      if shape[0] != Schedule.ASYNC]
            for sp in sorted(set(options.sequence_parallel)):
                for schedule, vpp in shapes:
                    config = _layer_config(model, cluster, options, global_batch, pp, sequences,
                                           schedule, vpp, sp)
                    if config is not None:
                        yield config


def _layer_config(model: ModelSpec, cluster: Cluster, options: SearchOptions, batch: int,
                  pp: int, sequences: int, schedule: Schedule, vpp: int,
                  sp: bool) -> Config | None:
    """One configuration of the per-layer space, or None when it offers nothing (no strategy,
    nothing to split along the sequence, a shape or tied ends the runtime refuses)."""
    strategies = layer_strategies(model, cluster, options, cluster.world_size // pp, sequences,
                                  schedule, sequence_parallel=sp)
    if not strategies or (sp and all(s.tp == 1 for s in strategies)):
        return None  # nothing to split along the sequence: the same as sp off
    # the data layout: at tp > 1 under sequence parallelism (a plan at tp 1 has no sequence
    # split, Plan drops the flag)
    first = next((s for s in strategies if s.tp > 1), strategies[0]) if sp else strategies[0]
    plan = Plan(model=model.name, seq_len=model.seq_len, global_batch=batch, tp=first.tp,
                dp=first.dp, zero=first.zero, pp=pp, micro_batch=sequences // first.dp,
                num_microbatches=batch // sequences, schedule=schedule, vpp=vpp,
                sequence_parallel=sp, dtype=options.dtype,
                fp8_scaling=options.fp8_scaling).with_even_stages(model)
    ends = None
    if options.runnable_only:
        if runnable_shape_refusal(model, plan) is not None:
            return None
        if model.tied_embeddings:  # one runnable layout for both
            ends = tuple(sorted({(s.tp, s.zero) for s in strategies if tied_ends_refusal(
                model, s, s, apart=plan.num_chunks > 1) is None}))
            if not ends:
                return None
    return Config(plan, (cluster.groups[0].gpu.name,) * pp, tuple(strategies), ends)
