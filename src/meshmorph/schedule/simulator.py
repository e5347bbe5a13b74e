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

from meshmorph.schedule.action import Action, Kind
from meshmorph.schedule.registry import frozen_actions, stage_to_rank
from meshmorph.schedule.validate import DeadlockError, peak_activations

_BLOCK = {Kind.F: 0, Kind.B: 1, Kind.W: 2, Kind.I: 3, Kind.STEP: 4}
"""Durations are one flat list: fwd + bwd + wgrad + igrad + step, each one entry per stage."""

Run = tuple[int, tuple[tuple[int, int, int, int], ...], tuple[tuple[str, int, int], ...]]
"""(rank, ops, names): consecutive actions of one rank. op = (dependency's end slot, or -1 for
W/STEP; transfer index or -1; duration index; own end slot); name = (kind, stage, micro-batch)."""


@dataclass(frozen=True, slots=True)
class Program:
    """An action list compiled for replay."""

    runs: tuple[Run, ...]
    """The sweep order, as runs of one rank's actions."""
    ranks: int
    """Pipeline ranks."""
    stages: int
    """Model chunks (stages)."""
    microbatches: int
    """Micro-batches per step."""
    peak_activations: tuple[int, ...]
    """Most (stage, micro-batch) activations each rank holds at once (F to its B, or to W)."""


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
        n = len(self.fwd_s)
        zeros = [0.0] * n
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
    """Most activations (stage, micro-batch pairs) each rank holds at once."""

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the average pipeline rank over the makespan."""
        if self.makespan_s <= 0:
            return 0.0
        idle = sum(self.makespan_s - busy for busy in self.rank_busy_s)
        return idle / (self.makespan_s * len(self.rank_busy_s))


def compile_program(orders: Sequence[Sequence[Action]], m: int, *, steps: bool = True) -> Program:
    """The sweep order of ``orders`` (one list per rank); STEPs dropped unless ``steps``."""
    stages = 1 + max((a.stage for order in orders for a in order), default=-1)
    last, zero = stages - 1, 2 * stages * m
    done_f = [[False] * m for _ in range(stages)]
    done_b = [[False] * m for _ in range(stages)]
    keep = {Kind.F, Kind.B, Kind.I, Kind.W} | ({Kind.STEP} if steps else set())
    plain = [[a for a in order if a.kind in keep] for order in orders]
    pos, lengths = [0] * len(plain), [len(order) for order in plain]
    remaining = sum(lengths)
    runs: list[Run] = []
    while remaining:
        progressed = False
        for k, order in enumerate(plain):
            i, run, named = pos[k], [], []
            while i < lengths[k]:
                kind, s, j = order[i]
                di = _BLOCK[kind] * stages + s
                if kind == Kind.F:
                    if s == 0:  # the first stage's inputs are ready at 0.0 (the zero slot)
                        op = (zero, -1, di, j)
                    elif not done_f[s - 1][j]:
                        break
                    else:
                        op = ((s - 1) * m + j, s - 1, di, s * m + j)
                    done_f[s][j] = True
                elif kind in (Kind.B, Kind.I):
                    if s == last:
                        if not done_f[s][j]:
                            break
                        op = (s * m + j, -1, di, (stages + s) * m + j)
                    elif not done_b[s + 1][j]:
                        break
                    else:
                        op = ((stages + s + 1) * m + j, s, di, (stages + s) * m + j)
                    done_b[s][j] = True
                else:  # W after its own I, STEP after the rank's previous action
                    op = (-1, -1, di, -1)
                run.append(op)
                named.append((str(kind), s, j))
                i += 1
            if run:
                runs.append((k, tuple(run), tuple(named)))
                remaining -= len(run)
                pos[k] = i
                progressed = True
        if not progressed:
            waiting = {k: str(plain[k][pos[k]]) for k in range(len(plain)) if pos[k] < lengths[k]}
            raise DeadlockError(f"the action lists deadlock: every unfinished rank waits "
                                f"(rank: next action) {waiting}; check the order of F and B")
    return Program(tuple(runs), len(orders), stages, m, peak_activations(orders))


@lru_cache(maxsize=256)
def schedule_program(name: str, p: int, m: int, v: int = 1, steps: bool = False) -> Program:
    """The compiled program of a named schedule, cached per shape."""
    return compile_program(frozen_actions(name, p, m, v, steps), m, steps=steps or name == "async")


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
    return Timeline(max(free), tuple(free), tuple(busy), tuple(records), program.peak_activations)


def simulate_actions(orders: Sequence[Sequence[Action]], times: StageTimes, *,
                     keep_ops: bool = True) -> Timeline:
    """Simulate any action lists (one per rank) on per-stage ``times``."""
    m = 1 + max((a.microbatch for order in orders for a in order), default=0)
    program = compile_program(orders, m)
    if len(times.fwd_s) != program.stages:
        raise ValueError(f"the actions use {program.stages} stages, the times list "
                         f"{len(times.fwd_s)}; give one time per stage")
    comm = list(times.p2p_s) if times.p2p_s is not None else [0.0] * program.stages
    return replay(program, times.durations(), comm, keep_ops)


def simulate_schedule(name: str, p: int, m: int, times: StageTimes, *, v: int = 1,
                      steps: bool = False, keep_ops: bool = True) -> Timeline:
    """Simulate the named schedule on per-stage ``times`` (STEPs priced when ``steps``)."""
    program = schedule_program(name, p, m, v, steps)
    if len(times.fwd_s) != program.stages:
        raise ValueError(f"schedule {name} with pp {p} runs {program.stages} stages, the times "
                         f"list {len(times.fwd_s)}; give one time per stage")
    comm = list(times.p2p_s) if times.p2p_s is not None else [0.0] * program.stages
    return replay(program, times.durations(), comm, keep_ops)


def local_transfers_zeroed(name: str, p: int, v: int, p2p_s: Sequence[float]) -> list[float]:
    """``p2p_s`` with 0 at the boundaries between two stages on the same rank (V's turn)."""
    ranks = stage_to_rank(name, p, v)
    return [0.0 if s + 1 < len(ranks) and ranks[s] == ranks[s + 1] else t
            for s, t in enumerate(p2p_s)]
