"""Run an assignment on CPU: one queue per stream, interleaved, waiting on cross-stream events.

The scheduler visits the streams round-robin and runs the head of a queue once every event it
waits on has been recorded, one operator per stream per round, so streams really interleave. It
writes the same trace a CUDA run would order by (wait, start, end, record), which ``race.py``
checks. ``StreamExecutor`` runs a traced module's operators this way through ``torch.fx``; each
operator is the same call as in eager mode, so outputs are bit-for-bit eager's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from meshmorph.streams.assign import StreamAssignment
from meshmorph.streams.op_graph import OpGraph
from meshmorph.streams.race import TraceEvent


class ScheduleError(RuntimeError):
    """The assignment cannot run: a deadlock, or an operator whose input is not computed yet."""


def run_schedule(assignment: StreamAssignment, run_op: Callable[[str], None]) -> list[TraceEvent]:
    """Call ``run_op`` for every operator in stream order, interleaving streams; return the trace."""
    waits = assignment.waits
    signals = {u for u, _ in assignment.syncs}
    queues = [deque(ops) for ops in assignment.streams]
    recorded: set[str] = set()
    trace: list[TraceEvent] = []
    while any(queues):
        progressed = False
        for s, queue in enumerate(queues):
            if not queue or not all(u in recorded for u in waits.get(queue[0], ())):
                continue
            op = queue.popleft()
            trace.extend(TraceEvent("wait", s, u) for u in waits.get(op, ()))
            trace.append(TraceEvent("start", s, op))
            run_op(op)
            trace.append(TraceEvent("end", s, op))
            if op in signals:
                trace.append(TraceEvent("record", s, op))
                recorded.add(op)
            progressed = True
        if not progressed:
            heads = {s: q[0] for s, q in enumerate(queues) if q}
            raise ScheduleError(f"deadlock: every stream waits on an event not yet recorded "
                                f"(stream heads {heads}); syncs must follow the streams' order")
    return trace


class StreamExecutor:
    """Calls a traced module's operators in the order an assignment gives, on CPU tensors."""

    def __init__(self, op_graph: OpGraph, assignment: StreamAssignment) -> None:
        if set(assignment.order) != set(op_graph.dag):
            raise ValueError("the assignment was made for another operator graph; assign "
                             "op_graph.dag first")
        self.op_graph = op_graph
        self.assignment = assignment
        self.last_trace: list[TraceEvent] = []
        self._nodes = {n.name: n for n in op_graph.module.graph.nodes}

    def __call__(self, *inputs: torch.Tensor) -> Any:
        interp = self.op_graph.interpreter(inputs)
        # readers not yet run, per value: a value is dropped after its last reader, as eager
        # mode would (the output node counts as a reader and never runs, so outputs stay)
        readers_left = {n: len(n.users) for n in self.op_graph.module.graph.nodes}

        def run_op(name: str) -> None:
            for member in self.op_graph.members.get(name, (name,)):
                node = self._nodes[member]
                missing = [p.name for p in node.all_input_nodes if p not in interp.env]
                if missing:
                    raise ScheduleError(f"{name} started before its inputs {missing} were "
                                        "computed: the assignment lacks a sync; use "
                                        "assign_streams' syncs")
                interp.env[node] = interp.run_node(node)
                for parent in node.all_input_nodes:
                    readers_left[parent] -= 1
                    if readers_left[parent] == 0:
                        del interp.env[parent]

        self.last_trace = run_schedule(self.assignment, run_op)
        return self.op_graph.output(interp)
