"""Pipeline schedules as per-rank op orders, and their simulation over unequal stage times.

An op is (kind, chunk, micro-batch) with kind F (forward), B (backward; input and weight
gradient together, or only the input gradient in zero-bubble schedules) or W (weight gradient).
Every rank runs its F and B ops in the listed order; an op starts when the rank is free and its
dependency has finished plus the point-to-point transfer:
F(c, j) after F(c-1, j); B(c, j) after B(c+1, j) (the last chunk's B after its own F);
W(c, j) after B(c, j). Start times are max-plus expressions of the durations, so the makespan
never decreases when a stage gets slower (the planner's bounds rely on it).
Zero-bubble (ZB-H1, Qi et al. 2023): B computes only the input gradient, so the backward chain
runs upstream faster; the order is the one torch.distributed.pipelining runs
(ScheduleInterleavedZeroBubble with one chunk per rank): 1F1B's F and B, pipeline rank k runs
the weight gradient of the backward k places earlier after each B, and its last k after its last
B, so it holds at most p micro-batches (1F1B's first stage). With F = B = W and m >= p this
gives the paper's ZB-H1 bubble (p - 1)(F + B - W), a third of 1F1B's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from meshmorph.spec.plan import Schedule

Op = tuple[str, int, int]  # (kind, chunk, micro-batch)


def _one_f_one_b(pp_rank: int, p: int, m: int) -> list[Op]:
    warmup = min(p - pp_rank - 1, m)
    ops: list[Op] = [("F", pp_rank, j) for j in range(warmup)]
    for j in range(warmup, m):
        ops.append(("F", pp_rank, j))
        ops.append(("B", pp_rank, j - warmup))
    ops.extend(("B", pp_rank, j) for j in range(m - warmup, m))
    return ops


def _zero_bubble_h1(pp_rank: int, p: int, m: int) -> list[Op]:
    # the order torch.distributed.pipelining runs (ScheduleInterleavedZeroBubble, one chunk per
    # rank): 1F1B's F and B (B = input gradient), each B followed by the weight gradient of the
    # backward pp_rank places earlier, the last pp_rank W ops at the end
    ops: list[Op] = []
    done_b = 0
    for op in _one_f_one_b(pp_rank, p, m):
        ops.append(op)
        if op[0] == "B":
            done_b += 1
            if done_b > pp_rank:
                ops.append(("W", pp_rank, done_b - 1 - pp_rank))
    ops.extend(("W", pp_rank, j) for j in range(max(0, m - pp_rank), m))
    return ops


def _gpipe(pp_rank: int, m: int) -> list[Op]:
    return [("F", pp_rank, j) for j in range(m)] + [("B", pp_rank, j) for j in range(m)]


def _interleaved(pp_rank: int, p: int, v: int, m: int) -> list[Op]:
    # Megatron's interleaved 1F1B: micro-batches in groups of p, chunk by chunk
    def unit(i: int, backward: bool) -> tuple[int, int]:
        group, within = divmod(i, p * v)
        local_chunk, offset = divmod(within, p)
        if backward:
            local_chunk = v - 1 - local_chunk
        return local_chunk * p + pp_rank, group * p + offset

    total = m * v
    warmup = min((p - pp_rank - 1) * 2 + (v - 1) * p, total)
    ops: list[Op] = [("F", *unit(i, False)) for i in range(warmup)]
    for i in range(warmup, total):
        ops.append(("F", *unit(i, False)))
        ops.append(("B", *unit(i - warmup, True)))
    ops.extend(("B", *unit(i, True)) for i in range(total - warmup, total))
    return ops


def schedule_ops(schedule: Schedule, p: int, m: int, v: int = 1) -> list[list[Op]]:
    """The op order of every pipeline rank."""
    if schedule == Schedule.GPIPE:
        return [_gpipe(k, m) for k in range(p)]
    if schedule == Schedule.INTERLEAVED:
        return [_interleaved(k, p, v, m) for k in range(p)]
    if schedule == Schedule.ZERO_BUBBLE:
        return [_zero_bubble_h1(k, p, m) for k in range(p)]
    return [_one_f_one_b(k, p, m) for k in range(p)]


@dataclass(frozen=True, slots=True)
class Timeline:
    """The simulated pipeline: per-rank finish time, busy time, and every op's interval."""

    makespan_s: float
    """Time from the first forward to the last backward/weight-gradient op."""
    rank_end_s: tuple[float, ...]
    """When each pipeline rank finishes its last op."""
    rank_busy_s: tuple[float, ...]
    """Compute time of each pipeline rank (the rest is bubble)."""
    ops: tuple[tuple[int, str, int, int, float, float], ...]
    """(pp_rank, kind, chunk, micro-batch, start_s, end_s) of every op."""

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the average pipeline rank over the makespan."""
        if self.makespan_s <= 0:
            return 0.0
        idle = sum(self.makespan_s - busy for busy in self.rank_busy_s)
        return idle / (self.makespan_s * len(self.rank_busy_s))


def simulate(schedule: Schedule, p: int, m: int, fwd_s: Sequence[float], bwd_s: Sequence[float],
             *, v: int = 1, wgrad_s: Sequence[float] | None = None,
             p2p_s: Sequence[float] | None = None, keep_ops: bool = False) -> Timeline:
    """Simulate one step. Per chunk c (``p * v`` of them): forward ``fwd_s[c]``, backward
    ``bwd_s[c]`` (input gradient only when ``wgrad_s`` is given, for zero-bubble) and the
    weight-gradient time ``wgrad_s[c]``; ``p2p_s[c]`` is the transfer from chunk c to c+1."""
    chunks = p * v
    if len(fwd_s) != chunks or len(bwd_s) != chunks:
        raise ValueError(f"need {chunks} chunk times, got {len(fwd_s)} and {len(bwd_s)}")
    split = schedule == Schedule.ZERO_BUBBLE
    if split and wgrad_s is None:
        raise ValueError("the zero-bubble schedule needs wgrad_s")
    w = list(wgrad_s) if split and wgrad_s is not None else [0.0] * chunks
    comm = list(p2p_s) if p2p_s is not None else [0.0] * chunks
    return _simulate_fixed(schedule, p, m, v, list(fwd_s), list(bwd_s), w, comm, keep_ops)


_KIND = {"F": 0, "B": 1, "W": 2}


@lru_cache(maxsize=256)
def _orders(schedule: Schedule, p: int, m: int, v: int) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """Op orders as (kind: 0 F / 1 B / 2 W, chunk, micro-batch), cached: the planner simulates
    one shape often."""
    return tuple(tuple((_KIND[kind], c, j) for kind, c, j in order)
                 for order in schedule_ops(schedule, p, m, v))


def _simulate_fixed(schedule: Schedule, p: int, m: int, v: int, fwd: list[float],
                    bwd: list[float], wgrad: list[float], comm: list[float],
                    keep_ops: bool) -> Timeline:
    """Every rank runs its ops in order; an op starts when the rank is free and its dependency
    has finished (plus the transfer). Start times depend only on finished dependencies, so the
    ranks are swept in turn until every op has run."""
    chunks = p * v
    last = chunks - 1
    orders = _orders(schedule, p, m, v)
    end_f = [[-1.0] * m for _ in range(chunks)]
    end_b = [[-1.0] * m for _ in range(chunks)]
    free = [0.0] * p
    busy = [0.0] * p
    pos = [0] * p
    lengths = [len(order) for order in orders]
    remaining = sum(lengths)
    records: list[tuple[int, str, int, int, float, float]] = []
    names = "FBW"
    while remaining:
        progressed = False
        for k in range(p):
            order, n, i, t = orders[k], lengths[k], pos[k], free[k]
            while i < n:
                kind, c, j = order[i]
                if kind == 0:
                    if c == 0:
                        ready = 0.0
                    else:
                        ready = end_f[c - 1][j]
                        if ready < 0:
                            break
                        ready += comm[c - 1]
                    d = fwd[c]
                    start = t if t > ready else ready
                    t = start + d
                    end_f[c][j] = t
                elif kind == 1:
                    if c == last:
                        ready = end_f[c][j]
                    else:
                        ready = end_b[c + 1][j]
                        if ready >= 0:
                            ready += comm[c]
                    if ready < 0:
                        break
                    d = bwd[c]
                    start = t if t > ready else ready
                    t = start + d
                    end_b[c][j] = t
                else:  # the weight gradient follows its own B, earlier on this rank
                    d = wgrad[c]
                    start = t
                    t += d
                if keep_ops:
                    records.append((k, names[kind], c, j, start, t))
                busy[k] += d
                i += 1
            if i != pos[k]:
                remaining -= i - pos[k]
                pos[k], free[k] = i, t
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {schedule} deadlocks for p={p}, m={m}, v={v}")
    return Timeline(max(free), tuple(free), tuple(busy), tuple(records))


def bubble_closed_form(schedule: Schedule, p: int, m: int, v: int = 1) -> float:
    """Bubble as a fraction of the ideal time for equal stages (Narayanan et al. 2021)."""
    if p == 1:
        return 0.0
    if schedule == Schedule.INTERLEAVED:
        return (p - 1) / (v * m)  # (p-1)/(v·m)
    return (p - 1) / m  # (p-1)/m for GPipe and 1F1B
