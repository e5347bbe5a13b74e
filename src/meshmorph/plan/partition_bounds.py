"""Lower bounds on the step of every stage partition that completes a partial one.

A rank s must run m forwards and backwards, after the first micro-batch reached it and before
the last backward left it, so any completion of a partial partition takes at least
max_s [sum_{r<s}(f_r + B_r) + m (f_s + b_s) + tail_s]; the layers still to place need at least
m x (their fastest total) / (ranks left) on some rank, and micro-batch 0 must pass forward
through them and back (B: the input-gradient part in zero-bubble, else the whole backward);
some rank left holds at least ceil(blocks left / ranks left) blocks; GPipe is a flow shop; and
for few micro-batches the chosen prefix followed by the smallest possible stages is simulated
(``simulate`` is monotone in the stage times). ``rank_step_bound`` is the one-rank bound both
partition searches read (over recompute choices, ``PartitionBounds``; over per-layer
assignment fronts, plan/partition_search.py's ``best_front_partition``).

``rest_bounds``: with per-layer strategies, the min-max program over stage ends that bounds
every completion of a partial partition and every configuration (plan/bounds.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from meshmorph.cost.layer_cost import PieceCost
from meshmorph.cost.model import steady_state
from meshmorph.cost.pipeline import deferred_weight_passes, forwards_before_backward, simulate
from meshmorph.plan.fastest_layers import fastest_layer_times, unique_gpus
from meshmorph.plan.relaxations import MemoryRelaxation, filled_share
from meshmorph.plan.stage_recompute import StageChoice, StageSolver
from meshmorph.schedule.table import Schedule
from meshmorph.spec.model import LayerKind
from meshmorph.spec.plan import Plan

if TYPE_CHECKING:
    from meshmorph.plan.rank_bound import SplitTable
    from meshmorph.plan.strategy_fronts import StageFronts

Chosen = Sequence[tuple[int, int, StageChoice]]


FILL_PAIRS = 8192
"""Largest pp x micro-batches whose action list the bounds read (each rank's warm-up forwards
and the W ops after its last input gradient); larger shapes take m for both, a weaker bound."""


def warmup_forwards(plan: Plan) -> tuple[int, ...] | tuple[None, ...]:
    """Per rank of a one-chunk pipeline, the forwards its action list runs before its first
    backward (``rank_step_bound``'s ``warm``); None each for shapes above the fill bounds'
    limit (``FILL_PAIRS``) and asynchronous plans."""
    p, m = plan.pp, plan.num_microbatches
    if plan.schedule == Schedule.ASYNC or p * m > FILL_PAIRS or plan.num_chunks != p:
        return (None,) * p
    return tuple(sum(count) for _, count in forwards_before_backward(plan.schedule, p, m))


def deferred_passes(plan: Plan) -> tuple[int, ...]:
    """Per rank of a zero-bubble pipeline, the W ops its action list may run after its last
    input gradient (m each above ``FILL_PAIRS``); 0 each for other schedules."""
    p, m = plan.pp, plan.num_microbatches
    if plan.schedule != Schedule.ZERO_BUBBLE:
        return (0,) * p
    return deferred_weight_passes(plan.schedule, p, m) if p * m <= FILL_PAIRS else (m,) * p


def rank_step_bound(schedule: Schedule, zb: bool, m: int, p: int, k: int, prefix_f: float,
                    prefix_b: float, f: float, b: float, b_whole: float, tail: float,
                    after: float, warm: int | None = None, w_before: float = 0.0) -> float:
    """No step is shorter, from pipeline rank k alone, holding one stage with forward ``f``,
    backward ``b_whole`` of which ``b`` is what the chain waits for (the input gradient under
    zero-bubble, ``zb``), and tail ``tail``; ``prefix_f`` and ``prefix_b`` are micro-batch 0's
    forward and backward chains through the ranks before it and ``after`` the least chain of
    the ranks after it. After rank k's last backward its tail and the backward chain to rank 0
    run side by side; under zero-bubble its W ops may also run after its last B. With ``warm``
    (the forwards its action list runs before its first backward): that backward waits for
    micro-batch 0's chain to the loss and back, and only those forwards run before it.
    ``w_before``: the W ops (zero-bubble) its action list runs before its last B."""
    if schedule == Schedule.ASYNC:  # no fill or drain: its own steady-state work
        return m * (f + b_whole) + tail
    back = 0.0 if warm is None else prefix_f + after + m * (f + b_whole) - (warm - 1) * f + max(
        tail, w_before + prefix_b - m * (b_whole - b))  # to the loss, back; then tail or drain
    if zb:
        return max(prefix_f + m * (f + b_whole) + tail,
                   prefix_f + m * (f + b) + w_before + prefix_b, back)
    generic = max(prefix_f + m * (f + b_whole) + max(tail, prefix_b), back)
    if schedule != Schedule.ONE_F_ONE_B:
        return generic
    # 1F1B: rank k runs m forwards and m - w backwards before its last forward ends, then
    # waits for that micro-batch's chain through the later ranks (or runs its w other
    # backwards), then its last backward; afterwards the tail, or the chain back to rank 0
    w = min(p - k - 1, m)
    last_b = prefix_f + m * f + (m - w) * b_whole + max(after, w * b_whole)
    return max(generic, last_b + max(tail, prefix_b))


class PartitionBounds:
    """The per-rank bounds of one configuration's stage search, with the suffix tables they
    read (built once from the layers' fastest times)."""

    def __init__(self, solver: StageSolver, table: SplitTable | None):
        cost, plan = solver.cost, solver.plan
        self.p, self.m = plan.pp, plan.num_microbatches
        self.schedule = plan.schedule
        self.zb = solver.zb
        self.warm = warmup_forwards(plan)
        self.deferred = deferred_passes(plan)
        self.w_before = tuple(self.m - n if self.zb else 0 for n in self.deferred)
        self.table = table
        self.p2p = [cost.p2p_time(plan, g) for g in solver.gpus]
        self.hop = min(self.p2p)  # as plan/bounds.py's fill tables count a hop
        L = solver.L
        fastest = fastest_layer_times(cost, plan, unique_gpus(cost, (g.name for g in solver.gpus)))
        # pigeonhole: some rank holds at least ceil(blocks left / ranks left) blocks
        layers = cost.model.layers
        blocks = [i for i in range(L) if layers[i].kind == LayerKind.BLOCK]
        self.block_time = min((fastest[i].work_s for i in blocks), default=0.0)
        self.blocks_after = [0] * (L + 1)
        # least_after[i]: the smallest one-layer stage among layers i.., per op kind (a stage
        # holds at least one layer), for the simulated bound of a partial partition
        self.least_after: list[tuple[float, float, float, float]] = [(0.0,) * 4] * (L + 1)
        acc = (float("inf"),) * 4
        # suffix sums: fastest work of layers [i, L), and of their forward + input-gradient chain
        self.suffix_min = [0.0] * (L + 1)
        self.suffix_chain = [0.0] * (L + 1)
        for index in range(L - 1, -1, -1):
            t = fastest[index]
            acc = (min(acc[0], t.fwd_s), min(acc[1], t.bwd_s), min(acc[2], t.bgrad_s),
                   min(acc[3], t.wgrad_s))
            self.least_after[index] = acc
            self.blocks_after[index] = self.blocks_after[index + 1] + (
                layers[index].kind == LayerKind.BLOCK)
            self.suffix_min[index] = self.suffix_min[index + 1] + t.work_s
            self.suffix_chain[index] = self.suffix_chain[index + 1] + t.chain_s
        self.simulates = self.m <= 4 * self.p and self.m * self.p <= (64 if self.zb else 256)
        """Few micro-batches: fill and drain decide, so partial partitions are simulated."""

    def step_b(self, t: PieceCost) -> float:
        """The backward the pipeline chain waits for (input gradient only in zero-bubble)."""
        return t.bgrad_s if self.zb else t.bwd_s

    def own(self, k: int, prefix_f: float, prefix_b: float, t: PieceCost, tail: float,
            after: float) -> float:
        """``rank_step_bound`` of rank k holding a stage of times ``t`` and tail ``tail``;
        ``prefix_b`` may be any least time from rank k's last backward to the step's end
        through the ranks before it (``rest``'s ``back``)."""
        return rank_step_bound(self.schedule, self.zb, self.m, self.p, k, prefix_f, prefix_b,
                               t.fwd_s, t.bgrad_s if self.zb else t.bwd_s, t.bwd_s, tail, after,
                               self.warm[k], self.w_before[k] * t.wgrad_s)

    def flow_shop(self, prefix: float, max_f: float, max_b: float, t: PieceCost,
                  after: float) -> float:
        """GPipe runs a forward then a backward flow shop of m identical jobs: each takes at
        least the sum of its stages plus (m - 1) x its slowest stage (0 for other schedules)."""
        if self.schedule != Schedule.GPIPE:
            return 0.0
        return prefix + t.fwd_s + t.bwd_s + after + (self.m - 1) * (
            max(max_f, t.fwd_s) + max(max_b, t.bwd_s))

    def drain_after(self, k: int, t: PieceCost, tail: float) -> float:
        """What rank k, holding a stage of times ``t`` and tail ``tail``, still runs after its
        last backward: its tail, and under zero-bubble the W ops its action list defers; less
        the k hops back to rank 0 that a chain ending on rank k does not take (the fill tables
        count every hop to rank 0)."""
        return tail + self.deferred[k] * t.wgrad_s - k * self.hop

    def rest(self, k: int, stop: int, prefix_f: float, prefix_b: float, t: PieceCost,
             back: float | None = None) -> float:
        """Lower bound from the ranks after k holding layers [stop, L), rank k's stage having
        times ``t`` and the ranks before it the chains ``prefix_f`` and ``prefix_b``; ``back``
        (default: the backward chain through ranks k..0): the least time from a later rank's
        last backward to the end of the step (the chain back to each rank r <= k, then what r
        runs after it, ``drain_after``)."""
        step_b = self.step_b(t)
        back = prefix_b + step_b if back is None else back
        m, left = self.m, self.p - 1 - k
        # a later rank s: at least the forward chain up to it plus m x its work (plus, without
        # zero-bubble, the backward chain back from it); micro-batch 0's whole chain
        heaviest = max(self.suffix_min[stop] / left,
                       -(-self.blocks_after[stop] // left) * self.block_time)
        upstream = 0.0 if self.zb else back
        spread = self.suffix_chain[stop] / filled_share(m, left)
        rest = max(prefix_f + t.fwd_s + m * heaviest + upstream,
                   prefix_f + prefix_b + t.fwd_s + step_b + max(self.suffix_chain[stop], spread))
        if self.schedule == Schedule.ASYNC:  # no fill: only the heaviest later rank's work
            rest = m * heaviest
        if self.table is not None:
            n = self.table.blocks_from(stop)
            rest = max(rest, self.table.rest[k + 1][n])
            for forward_only, fill in self.table.fill:
                # the chain through ranks 0..k as chosen, then the later ranks' own fill
                chain = prefix_f + t.fwd_s + (0.0 if forward_only else back)
                rest = max(rest, chain + fill[k + 1][n])
        return rest

    def simulated(self, chosen: Chosen, stop: int) -> float:
        """Simulate the stages chosen so far followed by ranks holding the smallest possible
        one-layer stage: every real completion is slower (simulate is monotone)."""
        f_min, b_min, bg_min, w_min = self.least_after[stop]
        left = self.p - len(chosen)
        times = [c.time for _, _, c in chosen]
        fwd = [t.fwd_s for t in times] + [f_min] * left
        bwd = [self.step_b(t) for t in times] + [bg_min if self.zb else b_min] * left
        wgrad = [t.wgrad_s for t in times] + [w_min] * left if self.zb else None
        if self.schedule == Schedule.ASYNC:
            return steady_state(fwd, bwd, self.m).makespan_s
        return simulate(self.schedule, self.p, self.m, fwd, bwd, wgrad_s=wgrad,
                        p2p_s=self.p2p).makespan_s

    def whole(self, choices: Chosen) -> float:
        """The per-rank bounds of a whole partition (cheap next to simulating it)."""
        times = [c.time for _, _, c in choices]
        chain = [t.fwd_s + self.step_b(t) for t in times]
        bound = prefix_f = prefix_b = 0.0
        for k, (_, _, choice) in enumerate(choices):
            t = choice.time
            bound = max(bound, self.own(k, prefix_f, prefix_b, t, choice.tail_s, sum(chain[k + 1:])))
            prefix_f += t.fwd_s
            prefix_b += chain[k] - t.fwd_s
        return bound


def rest_bounds(fronts: StageFronts) -> list[list[float]]:
    """``table[k][a]``: no completion in which ranks k.. hold layers [a, L) is faster, whatever the
    ranks before hold: the least over their partitions of the largest rank bound, each rank's
    figures the sums of its layers' least ones (the forward and backward chains before a rank
    too) and its busy time at least its memory relaxation's, so the table holds for every
    assignment that fits (a min-max program over stage ends)."""
    p, m, L, zb = fronts.p, fronts.m, fronts.L, fronts.zb
    one_f_one_b = fronts.plan.schedule == Schedule.ONE_F_ONE_B

    def prefix(values: list[float]) -> np.ndarray:
        return np.concatenate([[0.0], np.cumsum(values)])

    F, B = prefix(fronts.least_f), prefix(fronts.least_b)
    T, U = prefix(fronts.least_tail), prefix(fronts.least_busy)
    relaxed = [MemoryRelaxation(fronts.rows(k), fronts.cap) for k in range(p)]

    def rank(k: int, a: int, stops: np.ndarray) -> np.ndarray:
        pf, pb = F[a], B[a]
        f, bb, tail = F[stops] - pf, B[stops] - pb, T[stops] - T[a]
        busy = np.maximum(U[stops] - U[a], relaxed[k].busy_many(a, stops))
        bound = np.maximum(pf + busy, pf + m * (f + bb) + pb)
        if one_f_one_b and not zb:
            lag = min(p - k - 1, m)
            after = F[L] - F[stops] + B[L] - B[stops]
            bound = np.maximum(bound, pf + m * f + (m - lag) * bb + np.maximum(after, lag * bb)
                               + np.maximum(tail, pb))
        return bound

    inf = float("inf")
    table = [[inf] * (L + 1) for _ in range(p + 1)]
    for a in range(p - 1, L):
        table[p - 1][a] = float(rank(p - 1, a, np.array([L]))[0])
    for k in range(p - 2, -1, -1):
        later = np.array(table[k + 1])
        for a in range(k, L - (p - 1 - k)):
            stops = np.arange(a + 1, L - (p - 2 - k))
            if len(stops):
                table[k][a] = float(np.maximum(rank(k, a, stops), later[stops]).min())
    return table
