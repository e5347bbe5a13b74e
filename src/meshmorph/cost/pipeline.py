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

Run = tuple[int, tuple[tuple[int, int, int, int], ...], tuple[tuple[str, int, int], ...]]
"""(pp_rank, ops, names) of consecutive ops one rank runs. op = (dependency slot in the end
times, or -1 for a W op; transfer index, or -1 for none; duration index; own end-time slot);
name = (kind, chunk, micro-batch) of the same op."""


@lru_cache(maxsize=256)
def _orders(schedule: Schedule, p: int, m: int, v: int) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """Op orders as (kind: 0 F / 1 B / 2 W, chunk, micro-batch), cached: the planner simulates
    one shape often."""
    return tuple(tuple((_KIND[kind], c, j) for kind, c, j in order)
                 for order in schedule_ops(schedule, p, m, v))


@lru_cache(maxsize=256)
def _program(schedule: Schedule, p: int, m: int, v: int) -> tuple[Run, ...]:
    """The order in which the ranks are swept, as runs of ops, cached per shape.

    Whether an op can start depends only on which dependencies have run, never on the times,
    so the sweep (every rank in turn runs its ops until one waits on an op not yet run) is the
    same for every set of stage times: it is found once here and replayed by
    ``_simulate_fixed``. End times live in one flat list: F(c, j) at ``c * m + j``, B(c, j) at
    ``(chunks + c) * m + j``, and a last slot that stays 0.0 (the first chunk's forwards are
    ready at 0.0). Durations are indexed in fwd + bwd + wgrad."""
    chunks = p * v
    last = chunks - 1
    zero = 2 * chunks * m
    orders = _orders(schedule, p, m, v)
    done_f = [[False] * m for _ in range(chunks)]
    done_b = [[False] * m for _ in range(chunks)]
    pos = [0] * p
    lengths = [len(order) for order in orders]
    remaining = sum(lengths)
    runs: list[Run] = []
    names = "FBW"
    while remaining:
        progressed = False
        for k in range(p):
            order, n, i = orders[k], lengths[k], pos[k]
            run = []
            named = []
            while i < n:
                kind, c, j = order[i]
                if kind == 0:
                    if c == 0:
                        dep, transfer = zero, -1
                    else:
                        if not done_f[c - 1][j]:
                            break
                        dep, transfer = (c - 1) * m + j, c - 1
                    done_f[c][j] = True
                    run.append((dep, transfer, c, c * m + j))
                elif kind == 1:
                    if c == last:
                        if not done_f[c][j]:
                            break
                        dep, transfer = c * m + j, -1
                    else:
                        if not done_b[c + 1][j]:
                            break
                        dep, transfer = (chunks + c + 1) * m + j, c
                    done_b[c][j] = True
                    run.append((dep, transfer, chunks + c, (chunks + c) * m + j))
                else:
                    run.append((-1, -1, 2 * chunks + c, -1))
                named.append((names[kind], c, j))
                i += 1
            if run:
                runs.append((k, tuple(run), tuple(named)))
                remaining -= len(run)
                pos[k] = i
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {schedule} deadlocks for p={p}, m={m}, v={v}")
    return tuple(runs)


def _simulate_fixed(schedule: Schedule, p: int, m: int, v: int, fwd: list[float],
                    bwd: list[float], wgrad: list[float], comm: list[float],
                    keep_ops: bool) -> Timeline:
    """Every rank runs its ops in order; an op starts when the rank is free and its dependency
    has finished (plus the transfer). Start times depend only on finished dependencies, so the
    ranks are swept in turn until every op has run; the sweep order is fixed per shape
    (``_program``), so this replays it with the same float operations in the same order:
    ready = end of the dependency (+ transfer), start = max(free, ready), end = start + d."""
    program = _program(schedule, p, m, v)
    durations = fwd + bwd + wgrad
    end = [0.0] * (2 * p * v * m + 1)
    free = [0.0] * p
    busy = [0.0] * p
    records: list[tuple[int, str, int, int, float, float]] = []
    if keep_ops:
        append = records.append
        for k, ops, named in program:
            t = free[k]
            b = busy[k]
            for (dep, transfer, di, out), (name, c, j) in zip(ops, named, strict=True):
                d = durations[di]
                if dep < 0:  # the weight gradient follows its own B, earlier on this rank
                    start = t
                    t += d
                else:
                    ready = end[dep] if transfer < 0 else end[dep] + comm[transfer]
                    start = t if t > ready else ready
                    t = start + d
                    end[out] = t
                append((k, name, c, j, start, t))
                b += d
            free[k] = t
            busy[k] = b
    else:
        for k, ops, _ in program:
            t = free[k]
            b = busy[k]
            for dep, transfer, di, out in ops:
                d = durations[di]
                if dep < 0:
                    t += d
                else:
                    ready = end[dep] if transfer < 0 else end[dep] + comm[transfer]
                    t = (t if t > ready else ready) + d
                    end[out] = t
                b += d
            free[k] = t
            busy[k] = b
    return Timeline(max(free), tuple(free), tuple(busy), tuple(records))


def bubble_closed_form(schedule: Schedule, p: int, m: int, v: int = 1) -> float:
    """Bubble as a fraction of the ideal time for equal stages (Narayanan et al. 2021)."""
    if p == 1:
        return 0.0
    if schedule == Schedule.INTERLEAVED:
        return (p - 1) / (v * m)  # (p-1)/(v·m)
    return (p - 1) / m  # (p-1)/m for GPipe and 1F1B
