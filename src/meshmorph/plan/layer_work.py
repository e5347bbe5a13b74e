"""Lower bounds on the step of a configuration whose ranks hold several chunks (interleaved:
every chunk split at once; the V schedules: their even split), from prefix sums of its per-layer
times (no chunk priced, no schedule simulated). The V's bound: ``LayerWork.v_filled_s``.

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
(``least_rank_tail_s``: that traffic runs with rank 0's own actions, beside the others'). W_k is
the rank's forwards and backwards, where a chunk's f and b are its layers' (``CostModel.chunk_time``
adds any ZeRO traffic on top): Megatron's bubble, read rank by rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from meshmorph.cost.model import CostModel
from meshmorph.plan.fastest_layers import cluster_gpu
from meshmorph.plan.rank_bound import exposed_sync_s, params_line, rank_tail_line
from meshmorph.plan.space import Config
from meshmorph.schedule.one_f_one_b import rounds
from meshmorph.spec.gpus import GPUSpec
from meshmorph.spec.model import Recompute

PrefixSums = dict[tuple, tuple[np.ndarray, ...]]
"""Per-layer prefix sums (``LayerWork.prefix``) by (coster, GPU, micro-batch, tp, SP, mode),
shared by the configurations whose layers cost the same."""


class LayerWork:
    """The module's bounds for one configuration of several chunks per rank."""

    def __init__(self, cost: CostModel, config: Config, sums: PrefixSums | None = None):
        self.cost, self.plan = cost, config.plan
        plan = self.plan
        self.names = names = [config.rank_gpus[plan.pp_rank_of_chunk(c)]
                              for c in range(plan.num_chunks)]
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
        """Prefix sums over the model's layers of their forwards, backwards, compute without
        recompute, input and weight gradients under ``mode`` (layers without it: none)."""
        plan, model = self.plan, self.cost.model
        coster = self.cost.coster(plan)
        key = (id(coster), gpu.name, plan.micro_batch, plan.tp, plan.sequence_parallel, mode)
        found = self._sums.get(key)
        if found is None:
            sums = [[0.0] for _ in range(5)]
            for index, layer in enumerate(model.layers):
                c = coster.layer(index, gpu, plan.micro_batch, plan.tp, plan.sequence_parallel,
                                 mode if mode in layer.activation else Recompute.NONE)
                for out, value in zip(sums, (c.fwd_s, c.bwd_s, c.compute_s, c.bgrad_s,
                                             c.wgrad_s), strict=True):
                    out.append(out[-1] + value)
            found = self._sums[key] = tuple(np.array(out) for out in sums)
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

    def filled_s(self, splits: Sequence[tuple[int, ...]],
                 modes: Sequence[Recompute]) -> np.ndarray:
        """[mode, split]: for each chunk split of ``splits`` (block counts; the embedding joins
        the first chunk, the head the last) under each recompute mode of ``modes``, the
        module's bound."""
        plan = self.plan
        m, p, v = plan.num_microbatches, plan.pp, plan.vpp
        starts, stops = _spans(np.array(splits, dtype=np.int64).reshape(len(splits),
                                                                        plan.num_chunks))
        fwd = bwd = 0.0
        for name, on in self.on.items():
            f, b, compute = (np.stack(sums) for sums in zip(
                *(self.prefix(self.gpus[name], mode)[:3] for mode in modes), strict=True))
            fwd = fwd + np.where(on, f[:, stops] - f[:, starts], 0.0)
            bwd = bwd + np.where(on, b[:, stops] - b[:, starts], 0.0)
            if on[0]:  # the window rank 0's sync hides behind: its first chunk's compute
                window = 2 / 3 * (compute[:, stops[:, 0]] - compute[:, starts[:, 0]])
        # micro-batch 0's way to chunk c: forwards, and backwards on the way back, with hops
        there = np.cumsum(fwd + self.hops, axis=-1) - (fwd + self.hops)
        back = np.cumsum(bwd + self.hops, axis=-1) - (bwd + self.hops)
        # micro-batch 0's forwards to the loss, then backwards to chunk (v - 1) p + k
        loss = there[..., -1] + fwd[..., -1]
        later = np.cumsum((bwd + self.hops)[..., ::-1], axis=-1)[..., ::-1] - self.hops[-1]
        first = (v - 1) * p + np.arange(p)
        turn = loss[..., None] + later[..., first] - bwd[..., first]
        # chunk j p + k is rank k's
        shape = (len(modes), len(splits), v, p)
        work = m * (fwd + bwd).reshape(shape).sum(axis=-2)
        warm = (fwd.reshape(shape) * self._warmup()).sum(axis=-2)
        ranks = np.maximum(there[..., :p] + work, turn + work - warm) + back[..., :p]
        busy = work[..., 0]  # rank 0 alone: its actions from the start, ZeRO traffic and all
        params = self.params()
        rank0 = (params[stops[:, ::p]] - params[starts[:, ::p]]).sum(axis=1)
        least, slope, syncs = self.tail
        exposed = exposed_sync_s(syncs, rank0, window)
        # rank 0's own actions from the start, then all of its tail; any rank's chain back to
        # rank 0, then what rank 0 runs after its last backward
        # (a margin for the prefix sums' rounding: the cost model adds chunk by chunk)
        return (np.maximum(busy + least + slope * rank0,
                           ranks.max(axis=-1) + self.after[0] + self.after[1] * rank0)
                + exposed) * (1 - 1e-12)

    def v_filled_s(self, mode: Recompute) -> float:
        """The V schedules' bound (module docstring) for their even split under ``mode``:
        rank k holds chunks k and 2 pp - 1 - k, and under a split backward its weight
        gradients may run last, so nothing is known to follow its last action. Instead, every
        chunk c runs its m forwards (and its m backwards) one at a time on its rank: the last
        micro-batch to pass c forward still goes forward through the chunks after it and
        back through all of them, so no step is below micro-batch 0's chain through every
        chunk and back plus (m - 1) x the chunk's forward (or backward); and rank k starts
        nothing before micro-batch 0's forwards reached chunk k, then runs all its actions
        and its tail."""
        plan, cost = self.plan, self.cost
        m, p = plan.num_microbatches, plan.pp
        chunks = plan.num_chunks
        # Plan.with_even_stages's split: the layers between the first and the last, evenly
        base, extra = divmod(cost.model.num_layers - 2, chunks)
        starts, stops = _spans(np.array([base + (c < extra) for c in range(chunks)]))
        split = plan.schedule.split_backward
        fwd = back = work = compute = 0.0
        for name, on in self.on.items():
            f, b, c, bg, wg = (x[stops] - x[starts] for x in self.prefix(self.gpus[name], mode))
            fwd, compute = fwd + np.where(on, f, 0.0), compute + np.where(on, c, 0.0)
            # the backward the chain waits for (I under a split backward), and a chunk's work
            # as the simulator runs it (a split backward as I + W, or some as one full B)
            back = back + np.where(on, bg if split else b, 0.0)
            work = work + np.where(on, f + (np.minimum(b, bg + wg) if split else b), 0.0)
        hops = np.where(np.arange(chunks) == p - 1, 0.0, self.hops)  # the V's turn: one rank
        chain = fwd.sum() + back.sum() + 2 * hops[:-1].sum()
        params = self.params()
        held = params[stops] - params[starts]
        least, slope, syncs = self.after[0], self.after[1], self.tail[2]
        flow = chain + (m - 1) * max(fwd.max(), back.max()) + least + slope * held[[0, -1]].sum() \
            + exposed_sync_s(syncs, held[[0, -1]].sum(), 2 / 3 * compute[0])
        there = (np.cumsum(fwd + hops) - (fwd + hops))[:p]
        # rank k: chunks k and 2 pp - 1 - k, its sync behind its first one's compute
        own, busy = held[:p] + held[::-1][:p], m * (work[:p] + work[::-1][:p])
        ranks = 0.0
        for name, on in self.on.items():
            least, slope, syncs = rank_tail_line(cost, plan, self.gpus[name])
            value = there + busy + least + slope * own \
                + exposed_sync_s(syncs, own, 2 / 3 * compute[:p])
            ranks = max(ranks, float(np.where(on[:p], value, 0.0).max()))
        return max(flow, ranks) * (1 - 1e-12)

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


def _spans(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first layer, end) of each chunk holding ``counts`` blocks along the last axis, the
    embedding joining the first chunk and the head the last (``stages_of_counts``'s layout)."""
    counts = counts.copy()
    counts[..., 0] += 1
    counts[..., -1] += 1
    stops = np.cumsum(counts, axis=-1)
    return stops - counts, stops
