"""On CUDA: issue an assignment on CUDA streams with events, then capture it into a CUDA graph.

``CudaStreamRunner.issue`` forks every stream from the current one (an event they all wait on),
issues the operators in the assignment's global order, each under its stream; before an operator
its stream waits on the event of every sync parent, after a sync parent its stream records its
event; at the end the current stream waits on every stream (join). Issuing in one topological order
means every event is recorded before any wait on it is issued. Intermediates stay referenced until
the join, and the streams are used by this runner alone, always between a fork and a join, so the
caching allocator never hands a block to new work while another stream still reads it.

``StreamGraph`` captures that issue (and, with ``backward=True``, the backward from a static output
gradient: autograd runs each backward operator on its forward operator's stream) into a
``torch.cuda.CUDAGraph`` over static input buffers; ``replay`` copies new inputs in and replays.
"""

from __future__ import annotations

from typing import Any

import torch

from meshmorph.streams.assign import StreamAssignment
from meshmorph.streams.op_graph import OpGraph

WARMUP_STEPS = 3
"""Eager runs on a side stream before capture (cuDNN/cuBLAS choose algorithms, lazy init)."""


class CudaStreamRunner:
    """Issues a traced module's operators on one CUDA stream per assigned stream."""

    def __init__(self, op_graph: OpGraph, assignment: StreamAssignment) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CudaStreamRunner needs a CUDA device; on CPU use StreamExecutor")
        self.op_graph, self.assignment = op_graph, assignment
        self.streams = [torch.cuda.Stream() for _ in assignment.streams]
        self.stream_of, self.waits = assignment.stream_of, assignment.waits
        self.events = {u: torch.cuda.Event() for u, _ in assignment.syncs}
        self.fork = torch.cuda.Event()
        self.joins = [torch.cuda.Event() for _ in self.streams]
        self.nodes = {n.name: n for n in op_graph.module.graph.nodes}

    def issue(self, *inputs: torch.Tensor) -> Any:
        """Enqueue one forward on the streams; returns the output (valid on the current stream)."""
        interp = self.op_graph.interpreter(inputs)
        origin = torch.cuda.current_stream()
        self.fork.record(origin)
        for stream in self.streams:
            stream.wait_event(self.fork)
        for op in self.assignment.order:
            stream = self.streams[self.stream_of[op]]
            with torch.cuda.stream(stream):
                for parent in self.waits.get(op, ()):
                    stream.wait_event(self.events[parent])
                for member in self.op_graph.members.get(op, (op,)):
                    node = self.nodes[member]
                    interp.env[node] = interp.run_node(node)
                if op in self.events:
                    self.events[op].record(stream)
        for stream, join in zip(self.streams, self.joins, strict=True):
            join.record(stream)
            origin.wait_event(join)
        return self.op_graph.output(interp)


def _warm_up(step: Any, steps: int) -> None:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(steps):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


class _Captured:
    """A CUDA graph captured over static input buffers (``static_inputs``, ``static_output``)."""

    static_inputs: tuple[torch.Tensor, ...]
    static_output: Any
    graph: torch.cuda.CUDAGraph

    def replay(self, *inputs: torch.Tensor) -> Any:
        """Copy ``inputs`` into the static buffers, replay, return the static output buffer."""
        for static, new in zip(self.static_inputs, inputs, strict=True):
            static.copy_(new)
        self.graph.replay()
        return self.static_output


class StreamGraph(_Captured):
    """A forward (optionally with backward) on the assigned streams, captured once, replayed."""

    def __init__(self, op_graph: OpGraph, assignment: StreamAssignment,
                 example_inputs: tuple[torch.Tensor, ...], *, backward: bool = False) -> None:
        if backward and op_graph.training:
            raise ValueError("this graph is already a training step (forward and backward); "
                             "capture it with backward=False")
        self.runner = CudaStreamRunner(op_graph, assignment)
        self.static_inputs = tuple(x.detach().clone() for x in example_inputs)
        self.backward = backward
        self.static_grad_output: torch.Tensor | None = None
        params = list(op_graph.module.parameters())

        def step() -> Any:
            if not backward:
                with torch.no_grad():
                    return self.runner.issue(*self.static_inputs)
            out = self.runner.issue(*self.static_inputs)
            if self.static_grad_output is None:
                self.static_grad_output = torch.ones_like(out)
            out.backward(self.static_grad_output)
            current = torch.cuda.current_stream()
            for stream in self.runner.streams:  # backward ran on the forward's streams: join them
                current.wait_stream(stream)
            return out

        _warm_up(step, WARMUP_STEPS)
        for p in params:  # grads allocated inside the capture are overwritten by each replay
            p.grad = None
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.static_output = step()


class ModuleGraph(_Captured):
    """The baseline: a plain single-stream CUDA graph of ``module(*inputs)``."""

    def __init__(self, module: torch.nn.Module, example_inputs: tuple[torch.Tensor, ...]) -> None:
        self.static_inputs = tuple(x.detach().clone() for x in example_inputs)
        with torch.no_grad():
            _warm_up(lambda: module(*self.static_inputs), WARMUP_STEPS)
        self.graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(self.graph):
            self.static_output = module(*self.static_inputs)
