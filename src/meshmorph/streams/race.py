"""Race checks: no operator may start before every parent has finished and, if the parent ran on
another stream, before that stream has signalled it through an event the child's stream waited on.

``schedule_races`` proves it for every interleaving: each DAG edge u -> v must be implied by the
happens-before graph (stream order plus syncs). ``trace_races`` checks one run the way CUDA orders
work: vector clocks per stream, an event recorded on a stream captures its clock, a wait merges the
event's clock into the waiting stream's. A parent that merely finished earlier by luck, with no
event between the streams, is a race.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import networkx as nx

from meshmorph.streams.assign import StreamAssignment, happens_before


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """One step of a stream run."""

    kind: Literal["wait", "start", "end", "record"]
    """wait: the stream waits on ``op``'s event; start/end: ``op`` runs; record: ``op``'s event."""
    stream: int
    """The stream that takes the step."""
    op: str
    """The operator the step is about."""


@dataclass(frozen=True, slots=True)
class Race:
    """A child that could start before its parent's result is visible to its stream."""

    parent: str
    """The operator whose output is read."""
    child: str
    """The operator that reads it."""
    reason: str
    """Why the order is not guaranteed."""


def schedule_races(dag: nx.DiGraph, assignment: StreamAssignment) -> list[Race]:
    """Edges of ``dag`` that stream order plus the assignment's syncs do not imply."""
    stream_of = assignment.stream_of
    missing = set(dag) ^ set(stream_of)
    if missing:
        raise ValueError(f"the assignment and the DAG disagree on operators {sorted(missing)[:5]}; "
                         "assign the same DAG you check")
    order = happens_before(dag, assignment.streams, assignment.syncs)
    if not nx.is_directed_acyclic_graph(order):
        return [Race(u, v, "stream order and syncs form a cycle (deadlock)")
                for u, v in nx.find_cycle(order)]
    races = []
    for u in dag:
        after = nx.descendants(order, u)
        for v in dag.successors(u):
            if v not in after:
                where = "on the same stream after it" if stream_of[u] == stream_of[v] else (
                    f"on stream {stream_of[v]}, with no event chain from stream {stream_of[u]}")
                races.append(Race(u, v, f"{v} may start before {u} finishes: {where}"))
    return races


def trace_races(dag: nx.DiGraph, assignment: StreamAssignment,
                trace: list[TraceEvent]) -> list[Race]:
    """Starts in ``trace`` whose parents were not finished or not signalled to the child's stream."""
    stream_of = assignment.stream_of
    position = {op: i for ops in assignment.streams for i, op in enumerate(ops)}
    count = len(assignment.streams)
    clock = [[0] * count for _ in range(count)]  # clock[s][t]: ops of stream t visible to s
    event_clock: dict[str, list[int]] = {}
    finished: set[str] = set()
    races: list[Race] = []
    for ev in trace:
        s = ev.stream
        if ev.kind == "record":
            event_clock[ev.op] = list(clock[s])
        elif ev.kind == "wait":
            if ev.op not in event_clock:  # CUDA: waiting on a never-recorded event does nothing
                continue
            clock[s] = [max(a, b) for a, b in zip(clock[s], event_clock[ev.op], strict=True)]
        elif ev.kind == "end":
            clock[s][s] += 1
            finished.add(ev.op)
        else:
            v = ev.op
            if stream_of[v] != s or position[v] != clock[s][s]:
                races.append(Race(v, v, f"{v} started on stream {s} out of its stream's order"))
            for u in dag.predecessors(v):
                t = stream_of[u]
                if u not in finished:
                    races.append(Race(u, v, f"{v} started before {u} finished"))
                elif clock[s][t] <= position[u]:
                    races.append(Race(u, v, f"{v} on stream {s} started with no event from "
                                            f"stream {t} after {u}"))
    return races
