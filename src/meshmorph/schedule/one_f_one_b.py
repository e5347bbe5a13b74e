"""GPipe, 1F1B and interleaved 1F1B as per-rank action lists (compute actions only).

The orders are torch.distributed.pipelining's (``ScheduleGPipe``, ``Schedule1F1B``,
``ScheduleInterleaved1F1B``); ``tests/unit/test_schedule_torch.py`` compares them action for action.
Stage ``s`` of an interleaved schedule runs on rank ``s % p`` (looped placement).
"""

from __future__ import annotations

from meshmorph.schedule.action import Action, Kind


class ScheduleShapeError(ValueError):
    """A (schedule, pp, micro-batches, chunks) combination the schedule cannot run."""


def gpipe(p: int, m: int) -> list[list[Action]]:
    """All forwards, then all backwards, on every rank."""
    return [[Action(Kind.F, r, j) for j in range(m)] + [Action(Kind.B, r, j) for j in range(m)]
            for r in range(p)]


def one_f_one_b(p: int, m: int) -> list[list[Action]]:
    """PipeDream-flush 1F1B: rank r runs p - 1 - r warm-up forwards, then one forward and one
    backward in turn, then the remaining backwards."""
    return [_one_chunk(r, min(p - 1 - r, m), m, Kind.B, None) for r in range(p)]


def rounds(p: int, m: int, what: str) -> int:
    """Micro-batches per round of torch's interleaved schedules: m // max(1, m // p); m must
    split into whole rounds."""
    number_of_rounds = max(1, m // p)
    if m % number_of_rounds:
        raise ScheduleShapeError(
            f"{what} needs the {m} micro-batches to split into {number_of_rounds} equal rounds "
            f"(max(1, m // pp) with pp {p}); use a multiple of {number_of_rounds}, e.g. "
            f"{number_of_rounds * (m // number_of_rounds)}")
    return m // number_of_rounds


def zero_bubble_h1(p: int, m: int) -> list[list[Action]]:
    """ZB-H1 as torch runs it (``ScheduleInterleavedZeroBubble``, one chunk per rank): 1F1B's
    order with input-gradient backwards (I), rank r running the weight gradient (W) of the
    backward r places earlier after each I, and its last r W at the end."""
    return [_one_chunk(r, min(p - 1 - r, m), m, Kind.I, delay_weights=r) for r in range(p)]


def interleaved(p: int, m: int, v: int) -> list[list[Action]]:
    """Interleaved 1F1B (Narayanan et al. 2021) over v chunks per rank as torch runs it
    (``ScheduleInterleaved1F1B``): in rounds of R = m // max(1, m // p) micro-batches, step i
    of the forwards runs local chunk (i // R) % v, the backwards the chunks in reverse;
    rank r warms up with (v - 1) R + 2 (p - 1 - r) forwards."""
    if v == 1:
        return [_one_chunk(r, min(2 * (p - 1 - r), m), m, Kind.B, None) for r in range(p)]
    per_round = rounds(p, m, "interleaved 1F1B")
    total = m * v
    make, f, b = tuple.__new__, Kind.F, Kind.B

    def unit(i: int, backward: bool, r: int) -> tuple[int, int]:
        group, within = divmod(i, per_round * v)
        local_chunk, offset = divmod(within, per_round)
        if backward:
            local_chunk = v - 1 - local_chunk
        return local_chunk * p + r, group * per_round + offset  # (stage, micro-batch)

    orders = []
    for r in range(p):
        warmup = min((v - 1) * per_round + 2 * (p - 1 - r), total)
        order = [make(Action, (f, *unit(i, False, r))) for i in range(warmup)]
        for i in range(warmup, total):
            order.append(make(Action, (f, *unit(i, False, r))))
            order.append(make(Action, (b, *unit(i - warmup, True, r))))
        order += [make(Action, (b, *unit(i, True, r))) for i in range(total - warmup, total)]
        orders.append(order)
    return orders


def _one_chunk(r: int, warmup: int, m: int, backward: Kind, delay_weights: int | None
               ) -> list[Action]:
    """One chunk per rank (stage r): ``warmup`` forwards, then forward and backward in turn,
    then the remaining backwards; with ``delay_weights`` d, the W of backward k - d after
    backward k and the last d W at the end (torch's ``_get_1f1b_rank_ops``)."""
    f, w, make = Kind.F, Kind.W, tuple.__new__  # tuple.__new__: NamedTuple's own __new__
    order = [make(Action, (f, r, j)) for j in range(warmup)]  # is a slow Python lambda
    weights = 0
    for k in range(m):  # backward k, after forward warmup + k while forwards remain
        if warmup + k < m:
            order.append(make(Action, (f, r, warmup + k)))
        order.append(make(Action, (backward, r, k)))
        if delay_weights is not None and k >= delay_weights:
            order.append(make(Action, (w, r, weights)))
            weights += 1
    if delay_weights is not None:
        order += [make(Action, (w, r, j)) for j in range(weights, m)]
    return order
