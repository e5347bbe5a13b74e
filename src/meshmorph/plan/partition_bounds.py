"""Lower bounds on the step of every stage partition that completes a partial one.

A rank s must run m forwards and backwards, after the first micro-batch reached it and before
the last backward left it, so any completion of a partial partition takes at least
max_s [sum_{r<s}(f_r + B_r) + m (f_s + b_s) + tail_s]; the layers still to place need at least
m x (their fastest total) / (ranks left) on some rank, and micro-batch 0 must pass forward
through them and back (B: the input-gradient part in zero-bubble, else the whole backward);
some rank left holds at least ceil(blocks left / ranks left) blocks; GPipe is a flow shop; and
for few micro-batches the chosen prefix followed by the smallest possible stages is simulated
(``simulate`` is monotone in the stage times).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from meshmorph.cost.model import ChunkTime, steady_state
from meshmorph.cost.pipeline import simulate
from meshmorph.plan.fastest_layers import fastest_layer_times, unique_gpus
from meshmorph.plan.relaxations import filled_share
from meshmorph.plan.stage_recompute import StageChoice, StageSolver
from meshmorph.schedule.table import Schedule
from meshmorph.spec.model import LayerKind

if TYPE_CHECKING:
    from meshmorph.plan.rank_bound import SplitTable

Chosen = Sequence[tuple[int, int, StageChoice]]


class PartitionBounds:
    """The per-rank bounds of one configuration's stage search, with the suffix tables they
    read (built once from the layers' fastest times)."""

    def __init__(self, solver: StageSolver, table: SplitTable | None):
        cost, plan = solver.cost, solver.plan
        self.p, self.m = plan.pp, plan.num_microbatches
        self.schedule = plan.schedule
        self.zb = solver.zb
        self.table = table
        self.p2p = [cost.p2p_time(plan, g) for g in solver.gpus]
        L = solver.L
        fastest = fastest_layer_times(cost, plan, unique_gpus(cost, (g.name for g in solver.gpus)))
        # least_after[i]: the smallest one-layer stage among layers i.., per op kind (a stage
        # holds at least one layer), for the simulated bound of a partial partition
        self.least_after: list[tuple[float, float, float, float]] = [(0.0,) * 4] * (L + 1)
        acc = (float("inf"),) * 4
        for index in range(L - 1, -1, -1):
            t = fastest[index]
            acc = (min(acc[0], t.fwd_s), min(acc[1], t.bwd_s), min(acc[2], t.bgrad_s),
                   min(acc[3], t.wgrad_s))
            self.least_after[index] = acc
        # pigeonhole: some rank holds at least ceil(blocks left / ranks left) blocks
        layers = cost.model.layers
        blocks = [i for i in range(L) if layers[i].kind == LayerKind.BLOCK]
        self.block_time = min((fastest[i].work_s for i in blocks), default=0.0)
        self.blocks_after = [0] * (L + 1)
        # suffix sums: fastest work of layers [i, L), and of their forward + input-gradient chain
        self.suffix_min = [0.0] * (L + 1)
        self.suffix_chain = [0.0] * (L + 1)
        for index in range(L - 1, -1, -1):
            self.blocks_after[index] = self.blocks_after[index + 1] + (
                layers[index].kind == LayerKind.BLOCK)
            self.suffix_min[index] = self.suffix_min[index + 1] + fastest[index].work_s
            self.suffix_chain[index] = self.suffix_chain[index + 1] + fastest[index].chain_s
        self.simulates = self.m <= 4 * self.p and self.m * self.p <= (64 if self.zb else 256)
        """Few micro-batches: fill and drain decide, so partial partitions are simulated."""

    def step_b(self, t: ChunkTime) -> float:
        """The backward the pipeline chain waits for (input gradient only in zero-bubble)."""
        return t.bgrad_s if self.zb else t.bwd_s

    def own(self, k: int, prefix_f: float, prefix_b: float, t: ChunkTime, tail: float,
            after: float) -> float:
        """Lower bound on the step from rank k alone (``after``: least time of the chain of the
        ranks after k). After rank k's last backward, its tail and the backward chain to rank 0
        run side by side; in zero-bubble the rank's W ops may also run after its last B."""
        m, p = self.m, self.p
        if self.schedule == Schedule.ASYNC:  # no fill or drain: its own steady-state work
            return m * (t.fwd_s + t.bwd_s) + tail
        if self.zb:
            return max(prefix_f + m * (t.fwd_s + t.bwd_s) + tail,
                       prefix_f + m * (t.fwd_s + t.bgrad_s) + prefix_b)
        generic = prefix_f + m * (t.fwd_s + t.bwd_s) + max(tail, prefix_b)
        if self.schedule != Schedule.ONE_F_ONE_B:
            return generic
        # 1F1B: rank k runs m forwards and m - w backwards before its last forward ends, then
        # waits for that micro-batch's chain through the later ranks (or runs its w other
        # backwards), then its last backward; afterwards the tail, or the chain back to rank 0
        w = min(p - k - 1, m)
        last_b = prefix_f + m * t.fwd_s + (m - w) * t.bwd_s + max(after, w * t.bwd_s)
        return max(generic, last_b + max(tail, prefix_b))

    def flow_shop(self, prefix: float, max_f: float, max_b: float, t: ChunkTime,
                  after: float) -> float:
        """GPipe runs a forward then a backward flow shop of m identical jobs: each takes at
        least the sum of its stages plus (m - 1) x its slowest stage (0 for other schedules)."""
        if self.schedule != Schedule.GPIPE:
            return 0.0
        return prefix + t.fwd_s + t.bwd_s + after + (self.m - 1) * (
            max(max_f, t.fwd_s) + max(max_b, t.bwd_s))

    def rest(self, k: int, stop: int, prefix_f: float, prefix_b: float, t: ChunkTime) -> float:
        """Lower bound from the ranks after k holding layers [stop, L), rank k's stage having
        times ``t`` and the ranks before it the chains ``prefix_f`` and ``prefix_b``."""
        m, left = self.m, self.p - 1 - k
        step_b = self.step_b(t)
        # a later rank s: at least the forward chain up to it plus m x its work (plus, without
        # zero-bubble, the backward chain back from it); micro-batch 0's whole chain
        heaviest = max(self.suffix_min[stop] / left,
                       -(-self.blocks_after[stop] // left) * self.block_time)
        upstream = 0.0 if self.zb else prefix_b + step_b
        spread = self.suffix_chain[stop] / filled_share(m, left)
        rest = max(prefix_f + t.fwd_s + m * heaviest + upstream,
                   prefix_f + prefix_b + t.fwd_s + step_b + max(self.suffix_chain[stop], spread))
        if self.schedule == Schedule.ASYNC:  # no fill: only the heaviest later rank's work
            rest = m * heaviest
        if self.table is not None:
            rest = max(rest, self.table.rest[k + 1][self.table.blocks_from(stop)])
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
