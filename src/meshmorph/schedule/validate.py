"""Checks that per-rank action lists form a valid pipeline step, and their point-to-point actions.

Valid: every (stage, micro-batch) has one F and either one B or one I and one W, all on the rank
holding the stage, in the order F, then B/I, then W; every cross-rank hop has one SEND and one
RECV (when the lists carry them: ``with_comms`` adds them), the SEND after the action that makes
the tensor and the RECV before the one that uses it; and the ranks, each running its list in
order with blocking receives, all finish (no deadlock).
"""

from __future__ import annotations

from collections.abc import Sequence

from meshmorph.schedule.action import COMMS, Action, DeadlockError, Kind, ScheduleError
from meshmorph.schedule.simulator import compile_program

__all__ = ["DeadlockError", "ScheduleError", "check_schedule", "with_comms"]


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


def check_schedule(orders: Sequence[Sequence[Action]], ranks: Sequence[int], m: int) -> None:
    """Raise ScheduleError naming the first broken rule; return None for a valid step."""
    _check_complete(orders, ranks, m)
    if any(a.kind in COMMS for order in orders for a in order):
        _check_pairs(orders, ranks)
    # the ranks finish: the simulator's sweep raises DeadlockError otherwise (a receive blocks
    # as the action right after it does, so the sweep runs without them)
    compile_program([[a for a in order if a.kind not in COMMS] for order in orders], m,
                    stages=len(ranks))


def _check_complete(orders: Sequence[Sequence[Action]], ranks: Sequence[int], m: int) -> None:
    for r, order in enumerate(orders):
        seen: dict[tuple[Kind, int, int], int] = {}
        for i, a in enumerate(order):
            if ranks[a.stage] != r:
                raise ScheduleError(f"rank {r} runs {a} but stage {a.stage} lives on rank "
                                    f"{ranks[a.stage]}")
            if not 0 <= a.microbatch < m:
                raise ScheduleError(f"rank {r} runs {a} but the step has {m} micro-batches")
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
