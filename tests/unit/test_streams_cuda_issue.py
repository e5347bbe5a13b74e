"""The CUDA runner's issue order, checked on CPU: torch.cuda's Stream, Event and stream context are
replaced by recorders, and what the runner enqueues (waits, operators, records) is replayed by the
race checker under CUDA's ordering rules. The operators themselves run on CPU tensors."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from meshmorph.demos.nets import build_net, example_input
from meshmorph.streams import cuda_graph
from meshmorph.streams.assign import assign_streams
from meshmorph.streams.op_graph import build_op_graph
from meshmorph.streams.race import TraceEvent, trace_races


class FakeCuda:
    """Records what would be enqueued on each stream: ("wait"|"record", stream, event) and
    ("run", stream, node name)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int, object]] = []
        self.origin = self.Stream()
        self.current = self.origin

    def Stream(self) -> object:  # noqa: N802 - mirrors torch.cuda.Stream
        fake = self

        class _Stream:
            def wait_event(self, event: object) -> None:
                fake.log.append(("wait", id(self), event))

        return _Stream()

    def Event(self) -> object:  # noqa: N802 - mirrors torch.cuda.Event
        fake = self

        class _Event:
            def record(self, stream: object) -> None:
                fake.log.append(("record", id(stream), self))

        return _Event()

    @contextlib.contextmanager
    def stream(self, stream: object) -> Iterator[None]:
        previous, self.current = self.current, stream
        yield
        self.current = previous


@pytest.fixture()
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny convolutions: a second thread only waits on a busy machine
    yield
    torch.set_num_threads(threads)


@pytest.fixture()
def fake_cuda(monkeypatch, one_thread) -> FakeCuda:
    fake = FakeCuda()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Stream", fake.Stream)
    monkeypatch.setattr(torch.cuda, "Event", fake.Event)
    monkeypatch.setattr(torch.cuda, "stream", fake.stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: fake.current)
    run_node = torch.fx.Interpreter.run_node

    def logged(interp: torch.fx.Interpreter, node: torch.fx.Node) -> object:
        if node.op not in ("placeholder", "get_attr", "output"):
            fake.log.append(("run", id(fake.current), node.name))
        return run_node(interp, node)

    monkeypatch.setattr(torch.fx.Interpreter, "run_node", logged)
    return fake


def test_cuda_runner_enqueues_a_race_free_schedule_and_joins_every_stream(fake_cuda) -> None:
    model = build_net("inception-stack").eval()
    x = example_input(model, 1)
    graph = build_op_graph(model, (x,))
    assignment = assign_streams(graph.dag, graph.order)
    runner = cuda_graph.CudaStreamRunner(graph, assignment)
    fake_cuda.log.clear()
    with torch.no_grad():
        assert torch.equal(runner.issue(x), model(x))
    index = {id(s): i for i, s in enumerate(runner.streams)}
    op_of_event = {id(e): op for op, e in runner.events.items()}
    group_of = {m: op for op, ms in graph.members.items() for m in ms}
    assert len(group_of) > len(graph.members)  # flatten runs inside the pooling operator's group
    trace = []
    for kind, stream, what in fake_cuda.log:
        if stream not in index:
            continue  # the origin stream: fork and join
        if kind == "run":
            op = group_of[what]
            if what == graph.members[op][0]:
                trace.append(TraceEvent("start", index[stream], op))
            if what == graph.members[op][-1]:
                trace.append(TraceEvent("end", index[stream], op))
        elif id(what) in op_of_event:
            trace.append(TraceEvent(kind, index[stream], op_of_event[id(what)]))
    assert [e.op for e in trace if e.kind == "start"] == list(assignment.order)
    assert trace_races(graph.dag, assignment, trace) == []
    assert sum(e.kind == "wait" for e in trace) == len(assignment.syncs)
    # fork: every stream waits on the origin's event first; join: the origin waits on each stream
    origin = id(fake_cuda.origin)
    first_wait = {s: next(w for k, st, w in fake_cuda.log if st == id(s) and k == "wait")
                  for s in runner.streams}
    assert all(w is runner.fork for w in first_wait.values())
    joins_waited = [w for k, st, w in fake_cuda.log if k == "wait" and st == origin]
    assert joins_waited == runner.joins
