"""Lower bounds on the step time of a configuration, before its stages are chosen.

The planner visits configurations in order of these bounds and skips every one whose bound
reaches the best step found, so their tightness decides the search time.

- ``lower_bound`` (cheap, no memory): some pipeline rank does at least m x (fastest time of all
  layers) / pp; micro-batch 0 passes forward and backward through every layer; 1F1B and
  zero-bubble fill and drain (continuous relaxation); GPipe's flow shop; a pigeonhole bound on
  the blocks; gradient sync, optimizer and ZeRO-3 traffic, affine in a rank's parameters
  (``cost.rank_terms.least_rank_tail_s``).
- ``memory_bound``: memory forces recompute. For a model whose blocks are alike (one run of
  identical blocks between at most one layer before and one after, ``plan.block_run``),
  pipeline rank k holding n blocks needs at least h_k(n) (``plan.rank_bound``); the least
  max_k h_k(n_k) over all splits of the blocks is found greedily; infinity when even full
  recompute cannot fit the blocks. Two cheaper parts of it come first:
  ``busiest_memory_bound`` (the busiest bare rank) and ``ends_memory_bound`` (the ranks holding
  the embedding and the head as they are, the others as that bare rank).
- ``fill_bound``: the memory bound with the pipeline's fill and drain; ``integer_fill_bound``
  the same over whole blocks with every rank's warm-up and drain, over the splits within the
  incumbents' limit (the least h beyond bounds the rest).

A configuration with per-layer strategies (``Config.strategies``) gets its own two levels:
``lower_bound`` each rank's layers at their fastest (one stage, or the even chunks of the
interleaved and V schedules; any partition of a one-chunk pipeline: some rank runs 1/pp of the
layers' least busy time, and the bubble bound), ``memory_bound`` the same with each rank's busy
time under its memory cap (plan/relaxations.py's ``MemoryRelaxation``; one-chunk pipelines:
the least over stage partitions of the largest rank bound, plan/partition_bounds.py's
``rest_bounds``), and for even chunks the schedule simulated at every chunk's least figures.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass

import numpy as np

from meshmorph.cost.model import CostModel
from meshmorph.cost.pipeline import simulate, weight_copies
from meshmorph.cost.rank_terms import (
    device_reserve_bytes,
    in_flight_microbatches,
    least_rank_tail_s,
)
from meshmorph.cost.segments import autocast_stream, layer_plan
from meshmorph.plan.block_run import BlockRun, block_run
from meshmorph.plan.fastest_layers import cluster_gpu, fastest_layer_times, unique_gpus
from meshmorph.plan.layer_work import LayerWork, PrefixSums
from meshmorph.plan.partition_bounds import deferred_passes, rest_bounds, warmup_forwards
from meshmorph.plan.partition_search import interleaved_block_counts
from meshmorph.plan.rank_bound import (
    FillKind,
    RankBound,
    SplitTable,
    grouped_least_max,
    least_max,
)
from meshmorph.plan.relaxations import MemoryRelaxation, filled_share
from meshmorph.plan.space import Config
from meshmorph.plan.strategy_dp import TermsCache, stage_choices, stage_lower_bound_s
from meshmorph.plan.strategy_fronts import StageFronts
from meshmorph.schedule.table import Schedule
from meshmorph.spec.gpus import GPUSpec
from meshmorph.spec.model import LayerKind, Recompute
from meshmorph.spec.plan import Plan


@dataclass(frozen=True, slots=True)
class _Sums:
    """What ``lower_bound`` needs of the layers' fastest times (shared by many configurations)."""

    total: float
    """Sum over layers of the least forward + backward."""
    chain: float
    """Micro-batch 0's least chain through every layer (forward + the backward it waits for)."""
    total_f: float
    """Sum of the least forwards."""
    total_b: float
    """Sum of the least backwards."""
    block_time: float
    """Least forward + backward of one block."""
    block_params: float
    """Fewest parameters of one block on one tensor-parallel rank."""
    blocks: int
    """Number of blocks."""


class ConfigBounds:
    """Lower bounds of configurations on one CostModel, with what configurations share cached."""

    def __init__(self, cost: CostModel, modes: tuple[Recompute, ...]):
        self.cost = cost
        self.modes = modes
        self._sums: dict[tuple, _Sums] = {}
        self._ranks: dict[tuple, RankBound] = {}
        self._prefix_sums: PrefixSums = {}
        self._work: tuple[Config, LayerWork] | None = None
        self.cache: TermsCache = {}
        """Per-layer figures of configurations with layer strategies, shared with their solving
        (plan/solve_config.py)."""

    def __call__(self, config: Config) -> float:
        """The larger of the two bounds; infinity when no split of the layers fits memory."""
        memory = self.memory_bound(config)
        if memory == math.inf:
            return memory
        return max(memory, self.lower_bound(config))

    def _sums_of(self, plan: Plan, gpus: list[GPUSpec]) -> _Sums:
        key = (plan.dtype, plan.fp8_scaling, plan.micro_batch, plan.tp, plan.cp,
               plan.sequence_parallel,
               plan.schedule.split_backward, tuple(g.name for g in gpus),
               plan.overlap_grad_reduce, plan.tp_comm_overlap, plan.fsdp_prefetch,
               plan.compile, autocast_stream(plan))
        sums = self._sums.get(key)
        if sums is None:
            cost = self.cost
            fastest = fastest_layer_times(cost, plan, gpus)
            blocks = [i for i, layer in enumerate(cost.model.layers)
                      if layer.kind == LayerKind.BLOCK]
            sums = self._sums[key] = _Sums(
                total=sum(t.work_s for t in fastest), chain=sum(t.chain_s for t in fastest),
                total_f=sum(t.fwd_s for t in fastest), total_b=sum(t.bwd_s for t in fastest),
                block_time=min((fastest[i].work_s for i in blocks), default=0.0),
                block_params=min((cost.chunk_params(i, i + 1, plan.tp) for i in blocks),
                                 default=0.0),
                blocks=len(blocks))
        return sums

    def lower_bound(self, config: Config) -> float:
        """Some pipeline rank does at least m x (fastest time of all layers) / pp, and
        micro-batch 0 passes forward through every layer and backward again (input gradients
        only, for ZB)."""
        if config.strategies is not None:
            return self._layers_bound(config, memory=False)
        cost = self.cost
        plan = config.plan
        gpus = unique_gpus(cost, config.rank_gpus)
        sums = self._sums_of(plan, gpus)
        # tails and ZeRO-3 traffic are affine in a rank's parameters, so over the ranks they sum
        # to at least pp x their value at the average share: add that share to the average
        # rank's work
        m = plan.num_microbatches
        share = cost.chunk_params(0, cost.model.num_layers, plan.tp) / plan.pp
        bound = max(m * sums.total / plan.pp + min(least_rank_tail_s(cost, plan, share, g) for g in gpus),
                    0.0 if plan.schedule == Schedule.ASYNC else sums.chain)  # async: no fill
        if plan.pp > 1 and plan.schedule in (Schedule.ONE_F_ONE_B, Schedule.ZERO_BUBBLE):
            # every rank s needs sum_{r<s} w_r + m w_s (micro-batch 0's chain to it and back,
            # plus its own work; w = f + B). Over any split of the total W, the largest of these
            # is at least C with all of them equal: w_s = C (1 - 1/m)^s / m, so
            # C = W / (1 - (1 - 1/m)^p)
            bound = max(bound, sums.chain / filled_share(m, plan.pp))
        if plan.schedule == Schedule.GPIPE:
            # GPipe is a forward then a backward flow shop of m identical jobs: at least the sum
            # of the stages plus (m - 1) x the slowest stage, at least the average one
            bound = max(bound, sums.chain + (m - 1) * (sums.total_f + sums.total_b) / plan.pp)
        if sums.blocks:
            # pigeonhole: some rank holds ceil(blocks / pp) blocks, their work and their tail
            most = -(-sums.blocks // plan.pp)
            bound = max(bound, m * most * sums.block_time + min(
                least_rank_tail_s(cost, plan, most * sums.block_params, g) for g in gpus))
        return bound

    def busiest_memory_bound(self, config: Config, floor: float,
                             limit: float = math.inf) -> float:  # noqa: ARG002 (a Tightener)
        """A cheap part of ``memory_bound``: some rank holds ceil(blocks / pp) blocks, so it
        needs at least h(that many) of a rank that holds no layer before or after the blocks and
        keeps the fewest micro-batches in flight of any rank (h grows with the blocks, the fixed
        layers and the micro-batches in flight: with more in flight the bytes to free grow at
        least as fast as what recompute can free, or no recompute fits), on the GPU type where
        that is least. At least ``floor``. Synchronous pipelines of 3 ranks or more (rank 1
        holds neither end)."""
        found = self._fewest_in_flight(config, floor)
        if found is None:
            return floor
        run, fewest = found
        plan = config.plan
        most = -(-run.count // plan.pp)
        return max(floor, min(self._rank(plan, run, 1, gpu, fewest).h(most)
                              for gpu in set(config.rank_gpus)))

    def ends_memory_bound(self, config: Config, floor: float,
                          limit: float = math.inf) -> float:  # noqa: ARG002 (a Tightener)
        """The next part of ``memory_bound``: its least max over the splits of the blocks with
        the ranks that hold the ends (rank 0, the last, the head's) as they are and every other
        rank as ``busiest_memory_bound``'s rank of its GPU type, so that those share one h per
        type (``grouped_least_max``: a few greedy steps, not one per block). At least
        ``floor``; the same pipelines."""
        found = self._fewest_in_flight(config, floor)
        if found is None:
            return floor
        run, fewest = found
        plan = config.plan
        p = plan.pp
        ends = {0, p - 1, plan.pp_rank_of_chunk(plan.num_chunks - 1)}
        least = run.least_blocks(p)
        middle = Counter(config.rank_gpus[k] for k in range(p) if k not in ends)
        groups = [(self._rank(plan, run, k, config.rank_gpus[k]), 1, least[k]) for k in ends]
        groups += [(self._rank(plan, run, 1, gpu, fewest), ranks, 1)
                   for gpu, ranks in middle.items()]
        return max(floor, grouped_least_max(groups, run.count))

    def _fewest_in_flight(self, config: Config, floor: float) -> tuple[BlockRun, float] | None:
        """The model's run of alike blocks and the fewest micro-batches in flight of any rank,
        for the two bounds above; None where they do not apply (no such run, per-layer
        strategies, fewer than 3 ranks, an asynchronous pipeline, or nothing fits already)."""
        run, plan = block_run(self.cost.model), config.plan
        p = plan.pp
        if (run is None or config.strategies is not None or p < 3 or floor == math.inf
                or plan.schedule == Schedule.ASYNC):
            return None
        return run, min(in_flight_microbatches(plan.schedule, p, k, plan.num_microbatches,
                                               plan.vpp) for k in range(p))

    def memory_bound(self, config: Config) -> float:
        """The least max_k h_k(n_k) over every split of the blocks (see the module notes): 0
        when the model's layers are not a run of alike blocks, infinity when no split fits."""
        if config.strategies is not None:
            return self._layers_bound(config, memory=True)
        run = block_run(self.cost.model)
        if run is None:
            return 0.0
        plan = config.plan
        p = plan.pp
        ranks = [self._rank(plan, run, k, config.rank_gpus[k]) for k in range(p)]
        if p == 1:
            return ranks[0].h(run.count)
        # ranks that share their h (one RankBound) and fewest blocks
        groups = Counter(zip(ranks, run.least_blocks(p), strict=True))
        return grouped_least_max([(rank, count, least) for (rank, least), count in groups.items()],
                                 run.count)

    def fill_bound(self, config: Config, floor: float, limit: float = math.inf) -> float:
        """``memory_bound`` with the pipeline's fill: rank s starts its work only after
        micro-batch 0 went forward through every block before it (and, in 1F1B and GPipe, ends
        only after the last micro-batch's backward went back through them): at least
        max_s [c x (blocks before s) + K_s + h_s(n_s)], c the least per-block chain time.

        Least over splits by bisection on the step T: for a given T the ranks in order take as
        many blocks as their h allows (h interpolated linearly between whole blocks, a
        relaxation); a block more on an earlier rank costs each later rank at most c / (m x
        block work) <= 1/m of a block, so with m >= pp - 1 taking the most is optimal and T
        is feasible iff they take all blocks. ``floor`` is a known lower bound (the memory
        bound); returns at least it. Interleaved configurations: ``interleaved_bound``; the V
        schedules: plan/layer_work.py's ``v_filled_s`` at its least over the recompute modes.
        With a ``limit`` the bisection stops there: ``limit`` when the step cannot be below it."""
        run = block_run(self.cost.model)
        plan = config.plan
        if plan.schedule == Schedule.INTERLEAVED and config.strategies is None:
            return self.interleaved_bound(config, floor)
        if plan.schedule.v_shape and config.strategies is None and floor < math.inf \
                and self.cost.model.num_layers - 2 >= plan.num_chunks:
            work = self.layer_work(config)
            return max(floor, min(work.v_filled_s(mode) for mode in self.modes))
        p, m = plan.pp, plan.num_microbatches
        if (run is None or p == 1 or m < p - 1
                or plan.schedule not in (Schedule.ONE_F_ONE_B, Schedule.ZERO_BUBBLE, Schedule.GPIPE)
                or floor == math.inf):
            return floor
        ranks = [self._rank(plan, run, k, config.rank_gpus[k]) for k in range(p)]
        least = run.least_blocks(p)
        reserve = [sum(least[k + 1:]) for k in range(p)]
        hop = min(self.cost.p2p_time(plan, cluster_gpu(self.cost, g)) for g in config.rank_gpus)
        bound = floor
        # rank s starts after micro-batch 0's forward reached it, then does its work and tail;
        # in 1F1B and GPipe the last backward must also go back to rank 0 (which the tail
        # overlaps, so that variant leaves the tail out); in zero-bubble the last B goes back
        # after the rank's F and B ops (its W ops need not precede it)
        for kind, left_out in fill_kinds(plan)[:2]:  # the chains that run forward
            per_block = min(r.fill_chain(kind)[0] for r in ranks)
            entry = ranks[0].fill_chain(kind)[1]
            hops = hop * (1 if kind == FillKind.WITH_TAIL else 2)  # forward only, or both ways

            def feasible(step: float, per_block: float = per_block, entry: float = entry,
                         hops: float = hops, kind: FillKind = kind,
                         left_out: tuple[int, ...] = left_out) -> bool:
                placed = 0.0
                for k, rank in enumerate(ranks):
                    room = step - per_block * placed - (entry + hops * k if k else 0.0)
                    n = rank.capacity(room, run.count, kind, left_out[k])
                    if n < least[k]:
                        return False
                    # no more than the blocks left after the later ranks' least
                    placed += min(n, run.count - placed - reserve[k])
                return placed >= run.count - 1e-9

            lo, hi = bound, bound + per_block * run.count + (entry + hops) * p
            if feasible(lo):
                continue  # no better than the bound so far
            if limit < hi:
                if not feasible(limit):
                    return max(bound, limit)  # no split beats the incumbents
                hi = limit
            elif not feasible(hi):
                continue  # some h infinite everywhere
            for _ in range(40):
                mid = (lo + hi) / 2
                if feasible(mid):
                    hi = mid
                else:
                    lo = mid
                if hi - lo <= 2e-4 * hi:
                    break
            bound = max(bound, lo)
        return bound

    def layer_work(self, config: Config) -> LayerWork:
        """plan/layer_work.py's bound of an interleaved configuration (the last one asked for
        kept: its solving follows its bounding)."""
        if self._work is None or self._work[0] is not config:
            self._work = (config, LayerWork(self.cost, config, self._prefix_sums))
        return self._work[1]

    def interleaved_bound(self, config: Config, floor: float) -> float:
        """The least over the chunk splits the interleaved solve tries and the recompute modes
        of plan/layer_work.py's bound (the fill, rank by rank), at least ``floor``; infinity
        when there is no split (fewer blocks than chunks)."""
        splits = interleaved_block_counts(self.cost.model.num_blocks, config.plan.num_chunks)
        if not splits or floor == math.inf:
            return math.inf
        work = self.layer_work(config)
        return max(floor, float(work.filled_s(splits, self.modes).min()))

    def integer_fill_bound(self, config: Config, floor: float, limit: float = math.inf) -> float:
        """``fill_bound`` over whole blocks, for any number of micro-batches, with each rank's
        warm-up and drain: the least over splits into whole blocks of the largest of every
        rank's constraints at once (``_DrainTables.joint``). ``floor`` is a known lower bound;
        returns at least it. Only splits where every rank holds at most J blocks are read, J
        the most any rank holds with h within the ``limit`` (at most twice ``floor``): any
        other split has a rank with h above that, so the least h of J + 1 blocks bounds them
        all (a deep pipeline's tables shrink from blocks x blocks to blocks x J)."""
        run = block_run(self.cost.model)
        plan = config.plan
        p = plan.pp
        if (run is None or p == 1 or floor == math.inf
                or plan.schedule not in (Schedule.ONE_F_ONE_B, Schedule.ZERO_BUBBLE, Schedule.GPIPE)):
            return floor
        ranks = [self._rank(plan, run, k, config.rank_gpus[k]) for k in range(p)]
        hop = min(self.cost.p2p_time(plan, cluster_gpu(self.cost, g)) for g in config.rank_gpus)
        reach = min(limit, 2 * floor)  # before any incumbent: a split of twice the floor
        width = max(math.floor(rank.capacity(reach, run.count)) for rank in ranks)
        beyond = min(rank.h(width + 1) for rank in ranks) if width < run.count else math.inf
        if width < 0:
            return max(floor, beyond)
        drain = _DrainTables(ranks, run.least_blocks(p), run.count, hop, fill_kinds(plan), width)
        return max(floor, min(drain.joint(), beyond))

    def split_table(self, config: Config, limit: float = math.inf) -> SplitTable | None:
        """For the stage search: per pipeline rank k, the least max h over ranks k.. holding any
        number of the last blocks, and the block counts of the split that minimises the bound
        (a balanced start). None when the model is not a run of alike blocks. The one-chunk
        fill tables read only splits within the ``limit``'s window (``integer_fill_bound``;
        each table the least of that and what bounds the splits left out)."""
        run = block_run(self.cost.model)
        if run is None or config.plan.pp == 1:
            return None
        plan = config.plan
        p = plan.pp
        ranks = [self._rank(plan, run, k, config.rank_gpus[k]) for k in range(p)]
        least = run.least_blocks(p)
        rest: list[list[float]] = []
        balanced: list[int] = []
        for k in range(p):
            table, counts = least_max(ranks[k:], least[k:], run.count)
            rest.append(table)
            if k == 0 and table[run.count] < math.inf:
                balanced = counts
        return SplitTable(run, rest, balanced,
                          self._fill_tables(config, run, ranks, least, limit))

    def _fill_tables(self, config: Config, run: BlockRun, ranks: list[RankBound],
                     least: list[int], limit: float) -> tuple[tuple[bool, list[list[float]]], ...]:
        """For the stage search, per kind of ``fill_bound`` (whether its chain is the forward
        only, then the table): table[k][n] = the least over splits of the last n whole blocks
        (and the layer after them) among ranks k.. of max_s [c x (their blocks before s) +
        hops to s + h_s(n_s)] (h of the kind), so that no completion of stages chosen up to
        rank k - 1 whose chain through them is C ends before C + table[k][n]. A min-max
        program over whole block counts, one rank at a time, ranks before the last holding at
        most the blocks past which their own figures reach ``limit`` (``window_reaching``;
        the splits where one holds more: the least such figure, at least the limit, so that
        no cut at the limit is lost)."""
        plan = config.plan
        p = plan.pp
        if plan.schedule not in (Schedule.ONE_F_ONE_B, Schedule.ZERO_BUBBLE, Schedule.GPIPE):
            return ()
        count = run.count
        hop = min(self.cost.p2p_time(plan, cluster_gpu(self.cost, g)) for g in config.rank_gpus)
        kinds = fill_kinds(plan)
        blocks = np.arange(count + 1)
        out = []
        for kind, left_out in kinds[:2]:
            per_block = min(r.fill_chain(kind)[0] for r in ranks)
            hops = hop * (1 if kind == FillKind.WITH_TAIL else 2)
            own = [np.where(blocks >= least[k], r.values(kind, count, left_out[k]), math.inf)
                   + hops * k for k, r in enumerate(ranks)]
            width = window_reaching(own[:-1], limit)
            beyond = past_window(own[:-1], width)
            held = np.arange(width + 1)
            # rest[n, j] = n - j: the blocks the later ranks hold when this one holds j of n
            rest = blocks[:, None] - held[None, :]
            table = [np.full(count + 1, math.inf) for _ in range(p)]
            table[p - 1] = own[p - 1]
            for k in range(p - 2, -1, -1):
                later = np.where(rest >= 0, table[k + 1][np.clip(rest, 0, count)], math.inf)
                table[k] = np.minimum(np.maximum(own[k][None, :width + 1],
                                                 per_block * held[None, :] + later).min(axis=1),
                                      beyond[k])
            out.append((kind == FillKind.WITH_TAIL, [list(map(float, t)) for t in table]))
        back, between = _DrainTables(ranks, least, count, hop, kinds).tables(limit)
        out.append((True, [list(map(float, t)) for t in back]))  # from the forward chain on
        out.append((False, [list(map(float, t)) for t in between]))
        return tuple(out)

    def _rank(self, plan: Plan, run: BlockRun, k: int, gpu_name: str,
              in_flight: float | None = None) -> RankBound:
        """Rank k's ``RankBound`` (``in_flight``: in place of its own micro-batches in flight)."""
        p = plan.pp
        own = in_flight is None
        if own:
            in_flight = in_flight_microbatches(plan.schedule, p, k, plan.num_microbatches,
                                               plan.vpp)
        # everything RankBound reads of the plan and the rank (pp only through pp == 1)
        key = (gpu_name, plan.dtype, plan.fp8_scaling, plan.reduce_dtype, plan.micro_batch, plan.tp,
               plan.sequence_parallel, plan.dp, plan.cp, plan.zero, plan.num_microbatches, in_flight,
               k == 0, k == p - 1, p == 1,
               plan.pp_rank_of_chunk(plan.num_chunks - 1) == k,  # the head's loss buffers
               plan.overlap_grad_reduce, plan.overlap_param_gather, plan.tp_comm_overlap,
               plan.fsdp_prefetch, plan.compile, autocast_stream(plan),
               # asynchronous pipelines' weight copies (none for the others)
               weight_copies(plan.schedule, plan.weight_prediction, p, k, plan.num_microbatches))
        rank = self._ranks.get(key)
        if rank is None:
            gpu = cluster_gpu(self.cost, gpu_name)
            rank = self._ranks[key] = RankBound(self.cost, plan, run, k, gpu, self.modes,
                                                None if own else in_flight)
        return rank

    # --- configurations with per-layer strategies ----------------------------------------------
    def _layers_bound(self, config: Config, *, memory: bool) -> float:
        """No plan of a configuration with per-layer strategies is faster (module docstring)."""
        cost, plan, strategies = self.cost, config.plan, config.strategies
        assert strategies is not None
        gpu = cost.default_gpu()
        if plan.pp == 1 or plan.vpp > 1:
            cap = gpu.memory_bytes - device_reserve_bytes(cost, gpu)
            bound = 0.0
            for k in range(plan.pp):
                rows = stage_choices(cost, plan, k, 0, 0, strategies, self.modes, gpu, self.cache,
                                     rank_chunks(plan, k))
                bound = max(bound, stage_lower_bound_s(rows))
                if memory:
                    bound = max(bound, MemoryRelaxation(rows, cap).busy(0, len(rows)))
            if memory and plan.pp > 1:
                bound = max(bound, self._even_chunks_bound(config))
            return bound
        fronts = StageFronts(cost, plan, strategies, self.modes, gpu, self.cache)
        bubble = bubble_bound(fronts)
        if not memory:
            return max(sum(fronts.least_busy) / plan.pp, max(fronts.least_busy), bubble)
        return max(rest_bounds(fronts)[0][0], bubble)

    def _even_chunks_bound(self, config: Config) -> float:
        """No plan of an even-chunk configuration (interleaved, zbv, dualpipev) is faster: the
        schedule simulated with every chunk's forward, backward (input gradient under a split
        backward) and weight gradient each at the sum of its layers' least, no transition, and
        each rank's tail at its layers' least. Every assignment's figures are at least these
        and the simulator is max-plus (never faster when a figure grows)."""
        cost, plan, strategies = self.cost, config.plan, config.strategies
        assert strategies is not None
        gpu = cost.default_gpu()
        split = plan.schedule.split_backward
        fwd, bwd, wgrad = ([0.0] * plan.num_chunks for _ in range(3))
        tails = []
        for k in range(plan.pp):
            tail = 0.0
            rows = iter(stage_choices(cost, plan, k, 0, 0, strategies, self.modes, gpu,
                                      self.cache, rank_chunks(plan, k)))  # in chunk order
            for c in plan.chunks_of(k):
                for row in (next(rows) for _ in range(plan.stages[c].num_layers)):
                    fwd[c] += min(x.piece.fwd_s for x in row)
                    bwd[c] += min(x.piece.bwd_s - (x.piece.wgrad_s if split else 0.0)
                                  for x in row)
                    wgrad[c] += min(x.piece.wgrad_s for x in row)
                    tail += min(x.tail_s for x in row)
            tails.append(tail)
        send = min(cost.p2p_time(layer_plan(plan, s), gpu) for s in strategies)
        timeline = simulate(plan.schedule, plan.pp, plan.num_microbatches, fwd, bwd, v=plan.vpp,
                            p2p_s=(send,) * plan.num_chunks, wgrad_s=wgrad if split else None)
        return max(timeline.rank_end_s[k] + tails[k] for k in range(plan.pp))


def window_reaching(series: list[np.ndarray], limit: float) -> int:
    """The fewest blocks J such that every figure of ``series`` (one array per rank, by its
    blocks) past J is at least ``limit``: a split where some rank holds more than J blocks then
    reaches the limit by that rank's figure alone (0 when none is below it)."""
    below = [np.flatnonzero(values < limit) for values in series]
    return max((int(found[-1]) for found in below if len(found)), default=0)


def past_window(series: list[np.ndarray], width: int) -> np.ndarray:
    """[k]: the least figure of ``series`` past ``width`` blocks on ranks k.. (inf past the
    last rank)."""
    least = np.full(len(series) + 1, math.inf)
    for k in range(len(series) - 1, -1, -1):
        least[k] = min(least[k + 1], float(series[k][width + 1:].min(initial=math.inf)))
    return least


def fill_kinds(plan: Plan) -> tuple[tuple[FillKind, tuple[int, ...]], ...]:
    """The three fill bounds of a one-chunk pipeline, each with the ops every rank's value
    leaves out (``RankBound.value``): the forward chain with the tail; the chain there and
    back with the work (zero-bubble: less the W ops after the last input gradient); and the
    chain to the loss and back with h less the warm-up forwards (``_DrainTables``)."""
    p, m = plan.pp, plan.num_microbatches
    zb = plan.schedule == Schedule.ZERO_BUBBLE
    warm = tuple(m if w is None else w for w in warmup_forwards(plan))
    return ((FillKind.WITH_TAIL, (0,) * p),
            (FillKind.FB_OPS if zb else FillKind.WORK, deferred_passes(plan)),
            (FillKind.AFTER_WARMUP, warm))


class _DrainTables:
    """The fill bounds that read each rank's warm-up and drain, for one configuration of
    one-chunk ranks (``ranks``, rank k holding at least ``least[k]`` of the ``count`` blocks):

    - back: rank s's first backward waits for micro-batch 0's forward through every layer and
      its backward through the ranks after s; only its warm-up forwards run before it;
    - between: its last backward must then still go back through the ranks before s, and
      between its first and last backward it runs its other backwards, its forwards after the
      warm-up and the W ops it does not defer.

    A backward's chain through a rank carries the recompute its memory forces on every
    micro-batch (``RankBound.work``'s relaxation), so chains are summed rank by rank, each sum
    at its least over the splits of the blocks (``_least_sums``); the forward hops are counted
    from rank 0, as the other fill tables count them."""

    def __init__(self, ranks: list[RankBound], least: list[int], count: int, hop: float,
                 kinds: tuple[tuple[FillKind, tuple[int, ...]], ...], width: int | None = None):
        """``width``: only splits where no rank holds more blocks are read
        (``ConfigBounds.integer_fill_bound``)."""
        self.p, self.count, self.hop = len(ranks), count, hop
        self.ranks, self.least, self.kinds = ranks, least, kinds
        self.width = count if width is None else min(width, count)
        held = np.arange(self.width + 1)  # a rank's own blocks, j
        # [n, j]: the later ranks' share when rank k holds j of the last n blocks
        self.after = np.arange(count + 1)[:, None] - held[None, :]
        fwd, back, self.h, self.fb, self.warmed, self.between = map(list, zip(
            *(self._rank_series(k, self.width) for k in range(self.p)), strict=True))
        self._series = {"fwd": fwd, "back": back,
                        "both": [x + y for x, y in zip(fwd, back, strict=True)]}
        self._sums: dict[tuple[str, bool], list[np.ndarray]] = {}
        # every layer's least forward: the ranks' fixed layers and the blocks at their least
        self.forward_all = sum(r.fixed_fwd for r in ranks) + count * min(
            r.block_fwd for r in ranks) + hop * (self.p - 1)

    def _rank_series(self, k: int, most: int) -> tuple[np.ndarray, ...]:
        """Rank k's figures for 0..``most`` blocks (infinite where they do not fit): its
        forward, the backward its chain carries, h, its time of the chain kind, h less the
        warm-up, and the time between its first and last backward."""
        r, (chain_kind, deferred), warm = self.ranks[k], self.kinds[1], self.kinds[2][1][k]
        blocks = np.arange(most + 1)
        work = r.values(FillKind.WORK, most)
        fits = np.isfinite(work) & (blocks >= self.least[k])
        f = r.fixed_fwd + blocks * r.block_fwd
        block_b, fixed_b = r.back_chain(chain_kind == FillKind.FB_OPS)
        with np.errstate(invalid="ignore"):
            recompute = np.where(fits, work / r.m - (r.fixed_work + blocks * r.block_work), 0.0)
        b = fixed_b + blocks * block_b + recompute
        fb = r.values(chain_kind, most, deferred[k])
        with np.errstate(invalid="ignore"):  # inf - inf where the blocks do not fit
            between = np.where(fits, fb - warm * f - b, math.inf)
        return (np.where(fits, f, math.inf), np.where(fits, b, math.inf),
                np.where(fits, r.values(FillKind.WITH_TAIL, most), math.inf),
                np.where(fits, fb, math.inf),
                np.where(fits, r.values(FillKind.AFTER_WARMUP, most, warm), math.inf), between)

    def _least_sums(self, series: str, *, suffix: bool) -> list[np.ndarray]:
        """table[k][n]: the least sum of the ``series`` figures over the ranks k.. holding the
        last n blocks (``suffix``), or over the ranks before k holding the first n (k = 0..p);
        computed once, when first read."""
        found = self._sums.get((series, suffix))
        if found is not None:
            return found
        p, count, values = self.p, self.count, self._series[series]
        acc = np.where(np.arange(count + 1) == 0, 0.0, math.inf)
        take = np.clip(self.after, 0, count)
        tables = [acc]
        for k in range(p):
            later = np.where(self.after >= 0, acc[take], math.inf)
            acc = (values[p - 1 - k if suffix else k][None, :] + later).min(axis=1)
            tables.append(acc)
        found = self._sums[(series, suffix)] = tables[::-1] if suffix else tables
        return found

    def _min_max(self, own: list[np.ndarray]) -> list[np.ndarray]:
        """table[k][n]: the least over the splits of the last n blocks among ranks k.. of the
        largest own[s][n, n_s] (own[s] indexed by the blocks of ranks s.. and of rank s)."""
        p, count = self.p, self.count
        inner = np.where(np.arange(count + 1) == 0, 0.0, math.inf)
        take = np.clip(self.after, 0, count)
        tables = [inner] * (p + 1)
        for k in range(p - 1, -1, -1):
            later = np.where(self.after >= 0, inner[take], math.inf)
            inner = tables[k] = np.maximum(own[k], later).min(axis=1)
        return tables

    def _back_own(self, k: int) -> np.ndarray:
        """[n, j]: rank k holding j of the last n blocks, from micro-batch 0's forward reaching
        the loss: the backward chain of the ranks after it, the hops back, then its h less the
        warm-up."""
        later = self._least_sums("back", suffix=True)[k + 1]
        chain = np.where(self.after >= 0, later[np.clip(self.after, 0, self.count)], math.inf)
        return chain + self.hop * (self.p - 1 - k) + self.warmed[k][None, :]

    def tables(self, limit: float = math.inf) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """For the stage search (``SplitTable.fill``): the back table, from micro-batch 0's
        forward reaching rank k on (forward-only), and the between table, past the chain there
        and back through the ranks before k. Only splits within the window where every rank's
        own figures reach ``limit`` are read (``window_reaching``); each table is the least of
        that and the least own figure past it, which is at least the limit (the chains and
        sums the tables add are not negative)."""
        p = self.p
        own_back = [self.hop * (p - 1 - k) + self.warmed[k] for k in range(p)]
        width = window_reaching(own_back + self.between, limit)
        back_out, between_out = past_window(own_back, width), past_window(self.between, width)
        self._narrow(width)
        back = self._min_max([self._back_own(k) for k in range(p)])
        between = self._min_max([np.broadcast_to(self.between[k][None, :], self.after.shape)
                                 for k in range(p)])
        return ([np.minimum(back[k] + self._least_sums("fwd", suffix=True)[k], back_out[k])
                 + self.hop * (p - 1) for k in range(p)],
                [np.minimum(between[k] + self._least_sums("both", suffix=True)[k],
                            between_out[k]) + 2 * self.hop * (p - 1) for k in range(p)])

    def _narrow(self, width: int) -> None:
        """Read only splits where no rank holds more than ``width`` blocks from now on."""
        if width >= self.width:
            return
        assert not self._sums, "narrowed after a table was built"
        self.width, j = width, width + 1
        self.after = self.after[:, :j]
        for figures in (self.h, self.fb, self.warmed, self.between, *self._series.values()):
            figures[:] = [values[:j] for values in figures]

    def joint(self) -> float:
        """No step is shorter: every rank's fill, chain-there-and-back, back and between
        constraints of one split at once, least over the splits."""
        p, count, hop = self.p, self.count, self.hop
        before = np.broadcast_to((count - np.arange(count + 1))[:, None], self.after.shape)
        take = np.clip(self.after, 0, count)
        fwd_pre, both_pre, back_pre = (self._least_sums(series, suffix=False)
                                       for series in ("fwd", "both", "back"))
        back_suf = self._least_sums("back", suffix=True)
        own = []
        for k in range(p):
            chain_after = np.where(self.after >= 0, back_suf[k + 1][take], math.inf)
            own.append(functools.reduce(np.maximum, [
                fwd_pre[k][before] + hop * k + self.h[k][None, :],
                both_pre[k][before] + 2 * hop * k + self.fb[k][None, :],
                self.forward_all + self._back_own(k),
                self.forward_all + hop * (p - 1) + back_pre[k][before] + chain_after
                + (self._series["back"][k] + self.between[k])[None, :]]))
        return float(self._min_max(own)[0][count])


def rank_chunks(plan: Plan, k: int) -> list[tuple[int, int]]:
    """The layer ranges of pipeline rank ``k``'s chunks, in order."""
    return [(plan.stages[c].start, plan.stages[c].stop) for c in plan.chunks_of(k)]


def bubble_bound(fronts: StageFronts) -> float:
    """No partition of a one-chunk pipeline (GPipe, 1F1B, zero-bubble) is faster. Let x_k be
    stage k's forward plus backward (the input gradient under zero-bubble) per micro-batch and
    S_k = x_0 + ... + x_{k-1}: stage k cannot start before micro-batch 0's forwards of the
    stages before it, runs m forwards and backwards, and rank 0 cannot end before micro-batch
    m - 1's backward came back through those stages, so the step is at least m x_k + S_k for
    every k. Over all x >= 0 summing to X, the least of max_k (m x_k + S_k) is
    X / (1 - (1 - 1/m)^p) (``filled_share``: stage by stage, as large as the bound allows,
    gives the most work under it), and X is at least the layers' least forwards and
    backwards: ``lower_bound``'s fill bound over any split of the layers."""
    return (fronts.prefix_f[-1] + fronts.prefix_b[-1]) / filled_share(fronts.m, fronts.p)
