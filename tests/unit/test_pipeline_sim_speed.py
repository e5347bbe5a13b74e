"""The pipeline simulation against a frozen copy of its earlier, plainer implementation.

The fast simulation must give bit-identical results: every field of the Timeline compared with
``==``, over random schedules, shapes and stage times.
"""

from __future__ import annotations

import random
from typing import NamedTuple

import pytest

from meshmorph.cost.pipeline import simulate
from meshmorph.schedule.table import Schedule

# ---- frozen reference (private copy; used only by this test) --------------------------------

Op = tuple[str, int, int]


class _RefTimeline(NamedTuple):
    makespan_s: float
    rank_end_s: tuple[float, ...]
    rank_busy_s: tuple[float, ...]
    ops: tuple[tuple[int, str, int, int, float, float], ...]

    @property
    def bubble_fraction(self) -> float:
        if self.makespan_s <= 0:
            return 0.0
        idle = sum(self.makespan_s - busy for busy in self.rank_busy_s)
        return idle / (self.makespan_s * len(self.rank_busy_s))


def _ref_one_f_one_b(pp_rank: int, p: int, m: int) -> list[Op]:
    warmup = min(p - pp_rank - 1, m)
    ops: list[Op] = [("F", pp_rank, j) for j in range(warmup)]
    for j in range(warmup, m):
        ops.append(("F", pp_rank, j))
        ops.append(("B", pp_rank, j - warmup))
    ops.extend(("B", pp_rank, j) for j in range(m - warmup, m))
    return ops


def _ref_zero_bubble_h1(pp_rank: int, p: int, m: int) -> list[Op]:
    # the order torch.distributed.pipelining runs (ScheduleInterleavedZeroBubble, one chunk per
    # rank): 1F1B's F and B (B = input gradient), each B followed by the weight gradient of the
    # backward pp_rank places earlier, the last pp_rank W ops at the end
    ops: list[Op] = []
    done_b = 0
    for op in _ref_one_f_one_b(pp_rank, p, m):
        ops.append(op)
        if op[0] == "B":
            done_b += 1
            if done_b > pp_rank:
                ops.append(("W", pp_rank, done_b - 1 - pp_rank))
    ops.extend(("W", pp_rank, j) for j in range(max(0, m - pp_rank), m))
    return ops


def _ref_gpipe(pp_rank: int, m: int) -> list[Op]:
    return [("F", pp_rank, j) for j in range(m)] + [("B", pp_rank, j) for j in range(m)]


def _ref_interleaved(pp_rank: int, p: int, v: int, m: int) -> list[Op]:
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


def _ref_schedule_ops(schedule: Schedule, p: int, m: int, v: int = 1) -> list[list[Op]]:
    """The op order of every pipeline rank."""
    if schedule == Schedule.GPIPE:
        return [_ref_gpipe(k, m) for k in range(p)]
    if schedule == Schedule.INTERLEAVED:
        return [_ref_interleaved(k, p, v, m) for k in range(p)]
    if schedule == Schedule.ZERO_BUBBLE:
        return [_ref_zero_bubble_h1(k, p, m) for k in range(p)]
    return [_ref_one_f_one_b(k, p, m) for k in range(p)]


_REF_KIND = {"F": 0, "B": 1, "W": 2}


def _ref_orders(schedule: Schedule, p: int, m: int, v: int) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """Op orders as (kind: 0 F / 1 B / 2 W, chunk, micro-batch), cached: the planner simulates
    one shape often."""
    return tuple(tuple((_REF_KIND[kind], c, j) for kind, c, j in order)
                 for order in _ref_schedule_ops(schedule, p, m, v))


def _ref_simulate_fixed(schedule: Schedule, p: int, m: int, v: int, fwd: list[float],
                    bwd: list[float], wgrad: list[float], comm: list[float],
                    keep_ops: bool) -> _RefTimeline:
    """Every rank runs its ops in order; an op starts when the rank is free and its dependency
    has finished (plus the transfer). Start times depend only on finished dependencies, so the
    ranks are swept in turn until every op has run."""
    chunks = p * v
    last = chunks - 1
    orders = _ref_orders(schedule, p, m, v)
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
    return _RefTimeline(max(free), tuple(free), tuple(busy), tuple(records))


def _ref_simulate(schedule: Schedule, p: int, m: int, fwd_s: list[float], bwd_s: list[float],
                  *, v: int = 1, wgrad_s: list[float] | None = None,
                  p2p_s: list[float] | None = None, keep_ops: bool = False) -> _RefTimeline:
    chunks = p * v
    split = schedule == Schedule.ZERO_BUBBLE
    w = list(wgrad_s) if split and wgrad_s is not None else [0.0] * chunks
    comm = list(p2p_s) if p2p_s is not None else [0.0] * chunks
    return _ref_simulate_fixed(schedule, p, m, v, list(fwd_s), list(bwd_s), w, comm, keep_ops)


# ---- the comparison ----------------------------------------------------------------------------


def _random_case(rng: random.Random, schedule: Schedule) -> dict:
    p = rng.randint(1, 8)
    v = rng.randint(2, 4) if schedule == Schedule.INTERLEAVED else 1
    if schedule == Schedule.INTERLEAVED:
        m = p * rng.randint(1, max(1, 64 // p))  # Megatron's interleaving needs m a multiple of p
    else:
        m = rng.randint(1, 64)
    chunks = p * v
    style = rng.random()

    def times(n: int, lo: float, hi: float) -> list[float]:
        if style < 0.2:  # small whole numbers: many exact ties between ranks
            return [float(rng.randint(0, 3)) for _ in range(n)]
        return [rng.uniform(lo, hi) for _ in range(n)]

    case = {"schedule": schedule, "p": p, "m": m, "v": v,
            "fwd_s": times(chunks, 1e-4, 5e-2), "bwd_s": times(chunks, 1e-4, 1e-1)}
    if schedule == Schedule.ZERO_BUBBLE:
        case["wgrad_s"] = times(chunks, 1e-4, 5e-2)
    if rng.random() < 0.7:
        case["p2p_s"] = times(chunks, 0.0, 1e-2)
    case["keep_ops"] = rng.random() < 0.5
    return case


def _assert_identical(new: object, ref: _RefTimeline) -> None:
    assert new.makespan_s == ref.makespan_s
    assert new.rank_end_s == ref.rank_end_s
    assert new.rank_busy_s == ref.rank_busy_s
    assert new.ops == ref.ops
    assert new.bubble_fraction == ref.bubble_fraction
    assert type(new.makespan_s) is float
    assert all(type(x) is float for x in new.rank_end_s + new.rank_busy_s)


SCHEDULES = [Schedule.GPIPE, Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED, Schedule.ZERO_BUBBLE]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.value)
def test_simulate_bit_identical_to_reference_on_random_cases(schedule: Schedule) -> None:
    rng = random.Random(f"pipeline-sim-{schedule.value}")
    for _ in range(100):  # 400 cases over the four schedules
        case = _random_case(rng, schedule)
        args = {k: case[k] for k in ("schedule", "p", "m", "fwd_s", "bwd_s")}
        kwargs = {k: case[k] for k in ("v", "wgrad_s", "p2p_s", "keep_ops") if k in case}
        _assert_identical(simulate(*args.values(), **kwargs), _ref_simulate(*args.values(), **kwargs))


def test_simulate_same_inputs_twice_is_identical_and_cached_shapes_do_not_leak() -> None:
    # the memoised per-shape program must not carry state from one call to the next
    rng = random.Random(7)
    for schedule in SCHEDULES:
        v = 2 if schedule == Schedule.INTERLEAVED else 1
        for _ in range(5):
            fwd = [rng.uniform(0.01, 0.05) for _ in range(4 * v)]
            bwd = [rng.uniform(0.01, 0.1) for _ in range(4 * v)]
            w = [rng.uniform(0.01, 0.05) for _ in range(4 * v)]
            kw = {"v": v, "wgrad_s": w, "keep_ops": True}
            a = simulate(schedule, 4, 8, fwd, bwd, **kw)
            b = simulate(schedule, 4, 8, fwd, bwd, **kw)
            assert a == b
            _assert_identical(a, _ref_simulate(schedule, 4, 8, fwd, bwd, **kw))
