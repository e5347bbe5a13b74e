"""The catalog nets: width streams, an exact CPU stream run, and race checks that can fail."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import networkx as nx
import pytest
import torch

from meshmorph.demos.nets import NETS, build_net, example_input
from meshmorph.streams.assign import StreamAssignment, assign_streams
from meshmorph.streams.executor import ScheduleError, StreamExecutor, run_schedule
from meshmorph.streams.op_graph import OpGraph, build_op_graph
from meshmorph.streams.race import schedule_races, trace_races

# (operators, width, syncs) of each catalog net at its default size, batch 2
# (views such as flatten and Identity are folded into their producer: fold.py)
EXPECTED = {"inception-stack": (65, 4, 18), "nasnet-stack": (101, 12, 42), "resnet-stack": (30, 2, 4)}


@pytest.fixture(scope="module")
def traced() -> Iterator[dict[str, tuple[torch.nn.Module, torch.Tensor, OpGraph]]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny convolutions: a second thread only waits on a busy machine
    out = {}
    for name in NETS:
        model = build_net(name).eval()
        x = example_input(model, 2)
        out[name] = (model, x, build_op_graph(model, (x,)))
    yield out
    torch.set_num_threads(threads)


def largest_antichain(dag: nx.DiGraph) -> list[str]:
    """Independent of matching: a maximum clique of the incomparability graph (networkx)."""
    comparable = nx.transitive_closure_dag(dag).to_undirected()
    clique, _ = nx.max_weight_clique(nx.complement(comparable), weight=None)
    return clique


@pytest.mark.parametrize("name", list(NETS))
def test_catalog_net_gets_exactly_width_streams_and_nimbles_sync_count(traced, name: str) -> None:
    _, _, graph = traced[name]
    antichain = largest_antichain(graph.dag)
    assert all(not nx.has_path(graph.dag, u, v) for u in antichain for v in antichain if u != v)
    ours = assign_streams(graph.dag, graph.order)
    nimble = assign_streams(graph.dag, graph.order, method="nimble")
    ops, width, syncs = EXPECTED[name]
    assert (graph.dag.number_of_nodes(), len(antichain)) == (ops, width)
    assert (ours.width, len(ours.streams), len(ours.syncs)) == (width, width, syncs)
    # Nimble's path cover of the reduction needs more streams for the same (minimum) syncs
    assert len(nimble.syncs) == syncs
    assert len(nimble.streams) > width


@pytest.mark.parametrize("name", list(NETS))
def test_stream_executor_output_equals_eager_exactly_and_has_no_races(traced, name: str) -> None:
    model, x, graph = traced[name]
    for assignment in (assign_streams(graph.dag, graph.order),
                       assign_streams(graph.dag, graph.order, max_streams=2)):
        executor = StreamExecutor(graph, assignment)
        with torch.no_grad():
            assert torch.equal(executor(x), model(x))
        assert schedule_races(graph.dag, assignment) == []
        assert trace_races(graph.dag, assignment, executor.last_trace) == []
        starts = [ev.stream for ev in executor.last_trace if ev.kind == "start"]
        # streams interleave: the run switches stream more often than once per stream
        switches = sum(a != b for a, b in zip(starts, starts[1:], strict=False))
        assert switches >= len(assignment.streams)


def test_race_checks_catch_a_schedule_with_one_sync_removed(traced) -> None:
    _, x, graph = traced["inception-stack"]
    good = assign_streams(graph.dag, graph.order)
    dropped = good.syncs[0]
    broken = replace(good, syncs=good.syncs[1:])
    static = schedule_races(graph.dag, broken)
    assert [(r.parent, r.child) for r in static] == [dropped]
    dynamic = trace_races(graph.dag, broken, run_schedule(broken, lambda op: None))
    assert dropped in {(r.parent, r.child) for r in dynamic}
    with pytest.raises(ScheduleError, match="lacks a sync"):
        StreamExecutor(graph, broken)(x)


def test_trace_check_flags_a_parent_that_finished_first_without_an_event() -> None:
    dag = nx.DiGraph([("a", "b")])
    unsynced = StreamAssignment(order=("a", "b"), reduced_edges=(("a", "b"),),
                                streams=(("a",), ("b",)), syncs=(), width=1, method="test")
    trace = run_schedule(unsynced, lambda op: None)
    assert [(e.kind, e.op) for e in trace] == [("start", "a"), ("end", "a"), ("start", "b"),
                                               ("end", "b")]
    races = trace_races(dag, unsynced, trace)
    assert [(r.parent, r.child) for r in races] == [("a", "b")]
    assert "no event from stream 0" in races[0].reason
    synced = replace(unsynced, syncs=(("a", "b"),))
    assert trace_races(dag, synced, run_schedule(synced, lambda op: None)) == []


def test_syncs_against_stream_order_deadlock_with_a_clear_error() -> None:
    dag = nx.DiGraph([("a", "b"), ("c", "d")])
    crossed = StreamAssignment(order=("a", "b", "c", "d"), reduced_edges=(),
                               streams=(("b", "c"), ("d", "a")), syncs=(("a", "b"), ("c", "d")),
                               width=2, method="test")
    assert any("cycle" in r.reason for r in schedule_races(dag, crossed))
    with pytest.raises(ScheduleError, match="deadlock"):
        run_schedule(crossed, lambda op: None)


def test_stream_executor_in_training_matches_eager_outputs_exactly_and_gradients_to_rounding(
        traced) -> None:
    """Gradients: autograd adds the gradients of a tensor read by several operators in the order
    those operators ran, so a stream order reassociates those sums; nothing else may differ."""
    for name in ("inception-stack", "nasnet-stack"):
        model, x, graph = traced[name]
        model.train()  # batch statistics: outputs and gradients depend only on the batch
        try:
            executor = StreamExecutor(graph, assign_streams(graph.dag, graph.order))
            out = executor(x)
            assert torch.equal(out, model(x))
            out.square().sum().backward()
            ours = {n: p.grad.clone() for n, p in model.named_parameters()}
            model.zero_grad(set_to_none=True)
            model(x).square().sum().backward()
            for n, p in model.named_parameters():
                torch.testing.assert_close(ours[n], p.grad, rtol=1e-5, atol=1e-7)
            assert max(g.abs().max().item() for g in ours.values()) > 1e-3
        finally:
            model.eval()
            model.zero_grad(set_to_none=True)


def test_training_step_graph_on_streams_equals_its_program_order_run_and_eager_autograd() -> None:
    """The aten forward-backward graph: the stream executor reproduces the graph's own run bit for
    bit; against eager autograd the loss is equal and gradients agree up to rounding."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_net("resnet-stack").train()
        x = example_input(model, 2)
        graph = build_op_graph(model, (x,), training=True)
        assignment = assign_streams(graph.dag, graph.order)
        assert len(assignment.streams) == assignment.width > EXPECTED["resnet-stack"][1]
        executor = StreamExecutor(graph, assignment)
        with torch.no_grad():
            ours = executor(x)
            reference = graph.module(*graph.leading_inputs, x)
        assert len(ours) == len(reference) and all(
            torch.equal(a, b) for a, b in zip(ours, reference, strict=True))
        assert trace_races(graph.dag, assignment, executor.last_trace) == []
        params = dict(model.named_parameters())
        loss = model(x).float().square().mean()
        loss.backward()
        assert graph.loss_index == 3 * 9  # mean, var and count of its 9 batch norms
        assert torch.equal(ours[graph.loss_index], loss.detach())
        for name, grad in zip(params, ours[graph.loss_index + 1:], strict=True):
            torch.testing.assert_close(grad, params[name].grad, rtol=1e-5, atol=1e-7)
    finally:
        torch.set_num_threads(threads)


def test_operator_times_estimated_from_flops_or_measured_are_positive(traced) -> None:
    model, x, graph = traced["resnet-stack"]
    conv = graph.dag.nodes["stem_0"]
    # stem: 3 -> 16 channels, 3x3, 32x32 image, batch 2: 2 * (2*16*32*32) * (3*3*3) FLOPs
    assert conv["flops"] == 2 * (2 * 16 * 32 * 32) * 27
    assert conv["time_s"] > 5e-6  # the launch plus the roofline term
    measured = build_op_graph(model, (x,), timing="profile", repeats=1)
    assert set(measured.dag) == set(graph.dag)
    assert all(measured.dag.nodes[op]["time_s"] > 0 for op in measured.dag)
    with pytest.raises(ValueError, match="timing must be"):
        build_op_graph(model, (x,), timing="guess")  # type: ignore[arg-type]
