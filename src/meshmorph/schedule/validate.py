"""Checks that per-rank action lists form a valid pipeline step, and their point-to-point actions.

Valid: every (stage, micro-batch) has one F and either one B or one I and one W, all on the rank
holding the stage, in the order F, then B/I, then W; every cross-rank hop has one SEND and one
RECV (when the lists carry them: ``with_comms`` adds them), the SEND after the action that makes
the tensor and the RECV before the one that uses it; and the ranks, each running its list in
order with blocking receives, all finish (no deadlock).
"""

from __future__ import annotations

from collections.abc import Sequence

from meshmorph.schedule.action import COMMS, Action, Kind


class ScheduleError(ValueError):
    """Action lists that are not a valid pipeline step; the message names the broken rule."""


class DeadlockError(ScheduleError):
    """Every unfinished rank waits on an action no rank can run next."""


def with_comms(orders: Sequence[Sequence[Action]], ranks: Sequence[int]) -> list[list[Action]]:
    """``orders`` with SEND/RECV actions around every cross-rank hop: SEND_F(s, j) right after
    F(s, j), RECV_F(s + 1, j) right before F(s + 1, j); SEND_B(s, j) right after B/I(s, j),
    RECV_B(s - 1, j) right before B/I(s - 1, j). A stage field names the stage on that rank."""
    last = len(ranks) - 1
    out = []
    for order in orders:
        listed: list[Action] = []
        for a in order:
            s, j = a.stage, a.microbatch
            if a.kind == Kind.F and s > 0 and ranks[s - 1] != ranks[s]:
                listed.append(Action(Kind.RECV_F, s, j))
            if a.kind in (Kind.B, Kind.I) and s < last and ranks[s + 1] != ranks[s]:
                listed.append(Action(Kind.RECV_B, s, j))
            listed.append(a)
            if a.kind == Kind.F and s < last and ranks[s + 1] != ranks[s]:
                listed.append(Action(Kind.SEND_F, s, j))
            if a.kind in (Kind.B, Kind.I) and s > 0 and ranks[s - 1] != ranks[s]:
                listed.append(Action(Kind.SEND_B, s, j))
        out.append(listed)
    return out


def peak_activations(orders: Sequence[Sequence[Action]]) -> tuple[int, ...]:
    """Per rank, the most micro-batch activations held at once: one per F, released at its B,
    or at its W when the backward is split (the weight gradient still needs the inputs)."""
    split = {(a.stage, a.microbatch) for order in orders for a in order if a.kind == Kind.W}
    peaks = []
    for order in orders:
        held = peak = 0
        for a in order:
            if a.kind == Kind.F:
                held += 1
                peak = max(peak, held)
            elif (a.kind == Kind.B or (a.kind == Kind.W)
                  or (a.kind == Kind.I and (a.stage, a.microbatch) not in split)):
                held -= 1
        peaks.append(peak)
    return tuple(peaks)


def check_schedule(orders: Sequence[Sequence[Action]], ranks: Sequence[int], m: int) -> None:
    """Raise ScheduleError naming the first broken rule; return None for a valid step."""
    _check_complete(orders, ranks, m)
    if any(a.kind in COMMS for order in orders for a in order):
        _check_pairs(orders, ranks)
    _check_progress(orders, ranks)


def _check_complete(orders: Sequence[Sequence[Action]], ranks: Sequence[int], m: int) -> None:
    for r, order in enumerate(orders):
        seen: dict[tuple[Kind, int, int], int] = {}
        for i, a in enumerate(order):
            if ranks[a.stage] != r:
                raise ScheduleError(f"rank {r} runs {a} but stage {a.stage} lives on rank "
                                    f"{ranks[a.stage]}")
            if (a.kind, a.stage, a.microbatch) in seen and a.kind != Kind.STEP:
                raise ScheduleError(f"rank {r} runs {a} twice")
            seen[a.kind, a.stage, a.microbatch] = i
        for s in (s for s, k in enumerate(ranks) if k == r):
            for j in range(m):
                f, b = seen.get((Kind.F, s, j)), seen.get((Kind.B, s, j))
                inp, w = seen.get((Kind.I, s, j)), seen.get((Kind.W, s, j))
                if f is None:
                    raise ScheduleError(f"rank {r} never runs the forward {s}F{j}")
                if (b is None) == (inp is None) or (inp is None) != (w is None):
                    raise ScheduleError(f"stage {s} micro-batch {j} needs one B, or one I and "
                                        f"one W, on rank {r}")
                back = b if b is not None else inp
                if not f < back or (w is not None and not back < w):
                    raise ScheduleError(f"rank {r} runs stage {s} micro-batch {j} out of "
                                        f"order: F before B (or I) before W")


def _check_pairs(orders: Sequence[Sequence[Action]], ranks: Sequence[int]) -> None:
    expected = with_comms([[a for a in order if a.kind not in COMMS] for order in orders], ranks)
    for r, (got, want) in enumerate(zip(orders, expected, strict=True)):
        sends = [a for a in got if a.kind in COMMS]
        if sorted(sends) != sorted(a for a in want if a.kind in COMMS):
            raise ScheduleError(f"rank {r}'s sends and receives do not match its cross-rank "
                                f"hops; build them with with_comms")
        position = {a: i for i, a in enumerate(got)}
        for a in sends:
            maker = Action(Kind.F, a.stage, a.microbatch)
            if a.kind in (Kind.SEND_B, Kind.RECV_B):
                maker = Action(Kind.B, a.stage, a.microbatch)
                if maker not in position:
                    maker = Action(Kind.I, a.stage, a.microbatch)
            before = a.kind in (Kind.SEND_F, Kind.SEND_B)
            if (position[a] > position[maker]) != before:
                raise ScheduleError(f"rank {r}: {a} must come {'after' if before else 'before'}"
                                    f" {maker}")


def _check_progress(orders: Sequence[Sequence[Action]], ranks: Sequence[int]) -> None:
    """Run every rank's list with blocking receives (implicit ones where the list has none)."""
    done: set[tuple[Kind, int, int]] = set()
    pos = [0] * len(orders)
    last = len(ranks) - 1
    while any(pos[r] < len(order) for r, order in enumerate(orders)):
        progressed = False
        for r, order in enumerate(orders):
            while pos[r] < len(order):
                a = order[pos[r]]
                s, j = a.stage, a.microbatch
                if a.kind in (Kind.F, Kind.RECV_F) and s > 0 and (Kind.F, s - 1, j) not in done:
                    break
                if a.kind in (Kind.B, Kind.I, Kind.RECV_B):
                    if s < last and (Kind.B, s + 1, j) not in done:
                        break
                    if s == last and (Kind.F, s, j) not in done:
                        break
                done.add((Kind.B if a.kind == Kind.I else a.kind, s, j))
                pos[r] += 1
                progressed = True
        if not progressed:
            waiting = {r: str(order[pos[r]]) for r, order in enumerate(orders)
                       if pos[r] < len(order)}
            raise DeadlockError(f"the action lists deadlock: every unfinished rank waits "
                                f"(rank: next action) {waiting}")
