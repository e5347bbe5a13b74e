"""Lower bounds on an interleaved configuration's step for every chunk split at once, from
prefix sums of its per-layer times (no chunk priced, no schedule simulated).

In the interleaved schedule (schedule/one_f_one_b.py) rank k holds chunks k, k + p, ... and runs
its m forwards and backwards one at a time. Two facts bound the rank's end:

- every action it runs waits for some micro-batch's forwards through chunks 0..k-1 (each with
  a transfer to the next), and only its warm-up forwards (w_k of them, the first ones its list
  runs) precede its first backward, of chunk (v - 1) p + k for micro-batch 0, which waits for
  that micro-batch's forwards through every chunk and backwards back to it;
- after its last action some micro-batch's backward still passes chunks k-1..0 (its last action
  is a backward of a chunk j >= k, or a forward that a backward follows).

Rank 0 then adds its tail: its gradient sync and optimizer at their least, and the sync its first
chunk's compute cannot hide, as plan/rank_bound.py's ``RankBound.tail`` reads it (S_0). So no
step is below

    max_k [max(sum_{c<k} (f_c + hop_c) + m W_k,
               chain to the loss and back to chunk (v - 1) p + k + m W_k - warm-up_k)
           + sum_{c<k} (b_c + hop_c)] + S_0,

nor below m W_0 + S_0 + the least exposed part of rank 0's per-micro-batch ZeRO traffic
(``least_rank_tail_s``: that traffic runs with rank 0's own actions, beside the others'),

W_k the rank's forwards and backwards, where a chunk's f and b are its layers'
(``CostModel.chunk_time`` adds any ZeRO traffic on top): Megatron's bubble, read rank by rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from meshmorph.cost.model import CostModel
from meshmorph.plan.fastest_layers import cluster_gpu
from meshmorph.plan.rank_bound import params_line, rank_tail_line
from meshmorph.plan.space import Config
from meshmorph.schedule.one_f_one_b import rounds
from meshmorph.spec.gpus import GPUSpec
from meshmorph.spec.model import Recompute

PrefixSums = dict[tuple, tuple[np.ndarray, np.ndarray]]
"""Per-layer forward and backward prefix sums by (coster, GPU, micro-batch, tp, SP, mode), shared
by the configurations whose layers cost the same."""


class LayerWork:
    """The module's bound for the chunk splits of one interleaved configuration."""

    def __init__(self, cost: CostModel, config: Config, sums: PrefixSums | None = None):
        self.cost, self.plan = cost, config.plan
        plan = self.plan
        names = [config.rank_gpus[plan.pp_rank_of_chunk(c)] for c in range(plan.num_chunks)]
        self.gpus = {name: cluster_gpu(cost, name) for name in names}
        # the chunks on each GPU type (one type: all of them)
        self.on = {name: np.array([n == name for n in names]) for name in self.gpus}
        self.hops = sum(np.where(on, cost.p2p_time(plan, self.gpus[name]), 0.0)
                        for name, on in self.on.items())
        gpu = self.gpus[names[0]]  # rank 0 holds chunk 0
        self.tail = rank_tail_line(cost, plan, gpu)
        # what rank 0 runs after its last backward (its per-micro-batch ZeRO traffic, in the
        # least tail, runs with its own actions, beside the other ranks'), as a line
        self.after = params_line(*(sum(cost.rank_tail(plan, params, math.inf, gpu, least=True))
                                   for params in (1.0, 1e9)))
        self._sums = {} if sums is None else sums

    def prefix(self, gpu: GPUSpec, mode: Recompute) -> tuple[np.ndarray, ...]:
        """Prefix sums over the model's layers of their forwards, backwards and compute
        without recompute under ``mode`` (layers without it: none)."""
        plan, model = self.plan, self.cost.model
        coster = self.cost.coster(plan)
        key = (id(coster), gpu.name, plan.micro_batch, plan.tp, plan.sequence_parallel, mode)
        found = self._sums.get(key)
        if found is None:
            fwd, bwd, compute = [0.0], [0.0], [0.0]
            for index, layer in enumerate(model.layers):
                c = coster.layer(index, gpu, plan.micro_batch, plan.tp, plan.sequence_parallel,
                                 mode if mode in layer.activation else Recompute.NONE)
                fwd.append(fwd[-1] + c.fwd_s)
                bwd.append(bwd[-1] + c.bwd_s)
                compute.append(compute[-1] + c.compute_s)
            found = self._sums[key] = (np.array(fwd), np.array(bwd), np.array(compute))
        return found

    def params(self) -> np.ndarray:
        """Prefix sums over the model's layers of their parameters on one tp rank."""
        tp = self.plan.tp
        found = self._sums.get(("params", tp))
        if found is None:
            found = self._sums[("params", tp)] = np.cumsum(
                [0.0] + [self.cost.chunk_params(i, i + 1, tp)
                         for i in range(self.cost.model.num_layers)])
        return found

    def filled_s(self, splits: Sequence[tuple[int, ...]], mode: Recompute) -> np.ndarray:
        """For each chunk split of ``splits`` (block counts; the embedding joins the first
        chunk, the head the last) under ``mode``: the module's bound."""
        plan = self.plan
        m, p, v = plan.num_microbatches, plan.pp, plan.vpp
        counts = np.array(splits, dtype=np.int64).reshape(len(splits), plan.num_chunks)
        counts[:, 0] += 1
        counts[:, -1] += 1
        stops = np.cumsum(counts, axis=1)
        starts = stops - counts
        fwd = bwd = 0.0
        for name, on in self.on.items():
            f, b, compute = self.prefix(self.gpus[name], mode)
            fwd = fwd + np.where(on, f[stops] - f[starts], 0.0)
            bwd = bwd + np.where(on, b[stops] - b[starts], 0.0)
            if on[0]:  # the window rank 0's sync hides behind: its first chunk's compute
                window = 2 / 3 * (compute[stops[:, 0]] - compute[starts[:, 0]]) * (1 + 1e-12)
        # micro-batch 0's way to chunk c: forwards, and backwards on the way back, with hops
        there = np.cumsum(fwd + self.hops, axis=1) - (fwd + self.hops)
        back = np.cumsum(bwd + self.hops, axis=1) - (bwd + self.hops)
        # micro-batch 0's forwards to the loss, then backwards to chunk (v - 1) p + k
        loss = there[:, -1] + fwd[:, -1]
        later = np.cumsum((bwd + self.hops)[:, ::-1], axis=1)[:, ::-1] - self.hops[-1]
        first = (v - 1) * p + np.arange(p)
        turn = loss[:, None] + later[:, first] - bwd[:, first]
        # chunk j p + k is rank k's
        work = m * (fwd + bwd).reshape(len(splits), v, p).sum(axis=1)
        warm = fwd.reshape(len(splits), v, p) * self._warmup()[None]
        ranks = np.maximum(there[:, :p] + work, turn + work - warm.sum(axis=1)) + back[:, :p]
        busy = work[:, 0]  # rank 0 alone: its actions from the start, ZeRO traffic and all
        params = self.params()
        rank0 = (params[stops[:, ::p]] - params[starts[:, ::p]]).sum(axis=1)
        least, slope, syncs = self.tail
        exposed = 0.0
        for at_none, sync_slope, share, fraction, kept in syncs:  # RankBound.tail's exposed part
            exposed = exposed + kept * np.maximum(
                share * (at_none + sync_slope * rank0) * (1 - 1e-12) - fraction * window, 0.0)
        # rank 0's own actions from the start, then all of its tail; any rank's chain back to
        # rank 0, then what rank 0 runs after its last backward
        # (a margin for the prefix sums' rounding: the cost model adds chunk by chunk)
        return (np.maximum(busy + least + slope * rank0,
                           ranks.max(axis=1) + self.after[0] + self.after[1] * rank0)
                + exposed) * (1 - 1e-12)

    def _warmup(self) -> np.ndarray:
        """[j, k]: the forwards of rank k's local chunk j before its first backward (torch's
        ``ScheduleInterleaved1F1B``, schedule/one_f_one_b.py's ``interleaved``: its warm-up
        and the first forward of its steady state, R micro-batches of each chunk in turn)."""
        plan = self.plan
        m, p, v = plan.num_microbatches, plan.pp, plan.vpp
        per_round = rounds(p, m, "interleaved 1F1B")
        group = per_round * v
        out = np.zeros((v, p))
        for k in range(p):
            forwards = min((v - 1) * per_round + 2 * (p - 1 - k) + 1, m * v)
            whole, rest = divmod(forwards, group)
            for j in range(v):
                out[j, k] = whole * per_round + min(max(rest - j * per_round, 0), per_round)
        return out
