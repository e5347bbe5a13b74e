"""One event simulator for any per-rank action list: step time, bubble, peak activations.

Every rank runs its actions in order. F(s, j) starts when the rank is free and F(s - 1, j) has
ended plus the transfer ``p2p_s[s - 1]``; B or I (s, j) when B/I(s + 1, j) has ended plus
``p2p_s[s]`` (the last stage: when its own F(s, j) has ended); W and STEP follow the rank's
previous action. Point-to-point actions in a list are skipped: their cost is the transfer time
on the dependency. Start times are max-plus expressions of the durations, so the makespan never
falls when a stage gets slower (the planner's bounds rely on it).

Whether an action can start depends only on which actions have run, never on the times, so the
sweep (every rank in turn runs its actions until one waits on an action not yet run) is found
once per action list (``compile_program``) and replayed with the same float operations in the
same order for every set of times (``replay``): the planner simulates one shape thousands of times.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from meshmorph.schedule.action import Action, DeadlockError, Kind
from meshmorph.schedule.registry import frozen_actions, stage_to_rank
from meshmorph.schedule.table import Schedule

# Durations are one flat list: fwd + bwd + wgrad + igrad + step, one entry per stage each.

Run = tuple[int, tuple[tuple[int, int, int, int], ...], tuple[tuple[str, int, int], ...]]
"""(rank, ops, names): consecutive actions of one rank. op = (dependency's end slot, or -1 for
W/STEP; transfer index or -1; duration index; own end slot); name = (kind, stage, micro-batch)."""


class Program:
    """An action list compiled for replay."""

    __slots__ = ("_peaks", "microbatches", "orders", "ranks", "runs", "stages")

    def __init__(self, runs: tuple[Run, ...], ranks: int, stages: int, microbatches: int,
                 orders: Sequence[Sequence[Action]]) -> None:
        self.runs = runs
        """The sweep order, as runs of one rank's actions."""
        self.ranks, self.stages, self.microbatches = ranks, stages, microbatches
        """Pipeline ranks, model chunks (stages) and micro-batches per step."""
        self.orders = orders
        """The action lists it was compiled from."""
        self._peaks: tuple[int, ...] | None = None

    @property
    def peak_activations(self) -> tuple[int, ...]:
        """Most (stage, micro-batch) activations each rank holds at once (F to its B, or to
        its W), computed on first use (the planner never asks)."""
        if self._peaks is None:
            self._peaks = peak_activations(self.orders)
        return self._peaks


@dataclass(frozen=True, slots=True)
class StageTimes:
    """Per-stage durations in seconds (one entry per stage, i.e. model chunk)."""

    fwd_s: Sequence[float]
    """Forward F."""
    bwd_s: Sequence[float]
    """Full backward B (input and weight gradient)."""
    igrad_s: Sequence[float] | None = None
    """Input-gradient backward I (split schedules); None: same as ``bwd_s``."""
    wgrad_s: Sequence[float] | None = None
    """Weight-gradient backward W; None: 0."""
    p2p_s: Sequence[float] | None = None
    """Transfer from stage s to s + 1 (give 0 where both share a rank); None: 0."""
    step_s: Sequence[float] | None = None
    """Optimizer STEP of each stage; None: 0."""

    def durations(self) -> list[float]:
        """The flat duration list ``replay`` indexes."""
        zeros = [0.0] * len(self.fwd_s)
        return (list(self.fwd_s) + list(self.bwd_s) + list(self.wgrad_s or zeros)
                + list(self.igrad_s if self.igrad_s is not None else self.bwd_s)
                + list(self.step_s or zeros))


@dataclass(frozen=True, slots=True)
class Timeline:
    """One simulated step: per-rank finish and busy times, and every action's interval."""

    makespan_s: float
    """Time from the first action to the last."""
    rank_end_s: tuple[float, ...]
    """When each pipeline rank finishes its last action."""
    rank_busy_s: tuple[float, ...]
    """Compute time of each pipeline rank (the rest is bubble)."""
    ops: tuple[tuple[int, str, int, int, float, float], ...]
    """(rank, kind, stage, micro-batch, start_s, end_s) of every action (when kept)."""
    peak_activations: tuple[int, ...] = ()
    """Most activations (stage, micro-batch pairs) each rank holds at once (with the ops kept;
    empty otherwise, so that the planner's replays skip it)."""

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the average pipeline rank over the makespan."""
        if self.makespan_s <= 0:
            return 0.0
        idle = sum(self.makespan_s - busy for busy in self.rank_busy_s)
        return idle / (self.makespan_s * len(self.rank_busy_s))


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
            elif a.kind in (Kind.B, Kind.W) or (a.kind == Kind.I
                                                 and (a.stage, a.microbatch) not in split):
                held -= 1
        peaks.append(peak)
    return tuple(peaks)


def _codes(orders: Sequence[Sequence[Action]], steps: bool) -> list[list[tuple[int, int, int]]]:
    """Each action as (block code, stage, micro-batch): F 0, B 1, W 2, I 3, STEP 4; p2p dropped
    (identity tests: hashing an enum member runs Python code, and this runs per action)."""
    f, b, i, w, step = Kind.F, Kind.B, Kind.I, Kind.W, Kind.STEP
    out = []
    for order in orders:
        coded = []
        append = coded.append
        for kind, s, j in order:
            if kind is f:
                append((0, s, j))
            elif kind is b:
                append((1, s, j))
            elif kind is i:
                append((3, s, j))
            elif kind is w:
                append((2, s, j))
            elif kind is step and steps:
                append((4, s, j))
        out.append(coded)
    return out


_NAMES = ("F", "B", "W", "I", "STEP")


def compile_program(orders: Sequence[Sequence[Action]], m: int, *, steps: bool = True,
                    stages: int | None = None) -> Program:
    """The sweep order of ``orders`` (one list per rank); STEPs dropped unless ``steps``.
    ``stages``: the number of stages when known (else read off the actions)."""
    if stages is None:
        stages = 1 + max((a.stage for order in orders for a in order), default=-1)
    last, zero = stages - 1, 2 * stages * m
    done_f = [[False] * m for _ in range(stages)]
    done_b = [[False] * m for _ in range(stages)]
    plain = _codes(orders, steps)
    names = _NAMES
    pos, lengths = [0] * len(plain), [len(order) for order in plain]
    remaining = sum(lengths)
    runs: list[Run] = []
    while remaining:
        progressed = False
        for k in range(len(plain)):
            order, n, i = plain[k], lengths[k], pos[k]
            run: list[tuple[int, int, int, int]] = []
            named: list[tuple[str, int, int]] = []
            while i < n:
                code, s, j = order[i]
                if code == 0:  # F; the first stage's inputs are ready at 0.0 (the zero slot)
                    if s == 0:
                        run.append((zero, -1, s, j))
                    elif not done_f[s - 1][j]:
                        break
                    else:
                        run.append(((s - 1) * m + j, s - 1, s, s * m + j))
                    done_f[s][j] = True
                elif code == 1 or code == 3:  # B or I
                    if s == last:
                        if not done_f[s][j]:
                            break
                        run.append((s * m + j, -1, code * stages + s, (stages + s) * m + j))
                    elif not done_b[s + 1][j]:
                        break
                    else:
                        run.append(((stages + s + 1) * m + j, s, code * stages + s,
                                    (stages + s) * m + j))
                    done_b[s][j] = True
                else:  # W after its own I, STEP after the rank's previous action
                    run.append((-1, -1, code * stages + s, -1))
                named.append((names[code], s, j))
                i += 1
            if run:
                runs.append((k, tuple(run), tuple(named)))
                remaining -= len(run)
                pos[k] = i
                progressed = True
        if not progressed:
            waiting = {k: f"{plain[k][pos[k]][1]}{names[plain[k][pos[k]][0]]}"
                          f"{plain[k][pos[k]][2]}" for k in range(len(plain))
                       if pos[k] < lengths[k]}
            raise DeadlockError(f"the action lists deadlock: every unfinished rank waits "
                                f"(rank: next action) {waiting}; check the order of F and B")
    return Program(tuple(runs), len(orders), stages, m, orders)


@lru_cache(maxsize=256)
def schedule_program(name: str, p: int, m: int, v: int = 1, steps: bool = False) -> Program:
    """The compiled program of a named schedule, cached per shape."""
    return compile_program(frozen_actions(name, p, m, v, steps), m, steps=steps or not Schedule(name).info.flush,
                           stages=len(stage_to_rank(name, p, v)))


def replay(program: Program, durations: list[float], comm: Sequence[float],
           keep_ops: bool = False) -> Timeline:
    """Run ``program`` on ``durations`` (``StageTimes.durations`` layout) and transfers ``comm``:
    ready = end of the dependency (+ transfer), start = max(free, ready), end = start + d."""
    p = program.ranks
    end = [0.0] * (2 * program.stages * program.microbatches + 1)
    free = [0.0] * p
    busy = [0.0] * p
    records: list[tuple[int, str, int, int, float, float]] = []
    if keep_ops:
        append = records.append
        for k, ops, named in program.runs:
            t = free[k]
            b = busy[k]
            for (dep, transfer, di, out), (name, c, j) in zip(ops, named, strict=True):
                d = durations[di]
                if dep < 0:
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
        for k, ops, _ in program.runs:
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
    return Timeline(max(free), tuple(free), tuple(busy), tuple(records),
                    program.peak_activations if keep_ops else ())


def simulate_actions(orders: Sequence[Sequence[Action]], times: StageTimes, *,
                     keep_ops: bool = True) -> Timeline:
    """Simulate any action lists (one per rank) on per-stage ``times``."""
    m = 1 + max((a.microbatch for order in orders for a in order), default=0)
    return _simulate(compile_program(orders, m), times, keep_ops, "the actions use")


def simulate_schedule(name: str, p: int, m: int, times: StageTimes, *, v: int = 1,
                      steps: bool = False, keep_ops: bool = True) -> Timeline:
    """Simulate the named schedule on per-stage ``times`` (STEPs priced when ``steps``)."""
    return _simulate(schedule_program(name, p, m, v, steps), times, keep_ops,
                     f"schedule {name} with pp {p} runs")


def _simulate(program: Program, times: StageTimes, keep_ops: bool, what: str) -> Timeline:
    if len(times.fwd_s) != program.stages:
        raise ValueError(f"{what} {program.stages} stages, the times list {len(times.fwd_s)}; "
                         "give one time per stage")
    comm = list(times.p2p_s) if times.p2p_s is not None else [0.0] * program.stages
    return replay(program, times.durations(), comm, keep_ops)


def local_transfers_zeroed(name: str, p: int, v: int, p2p_s: Sequence[float]) -> list[float]:
    """``p2p_s`` with 0 at the boundaries between two stages on the same rank (V's turn)."""
    ranks = stage_to_rank(name, p, v)
    return [0.0 if s + 1 < len(ranks) and ranks[s] == ranks[s + 1] else t
            for s, t in enumerate(p2p_s)]
