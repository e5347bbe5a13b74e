"""On a CUDA device: the multi-stream CUDA graph replays to eager's outputs, and its kernels overlap.

Skipped where CUDA is absent (tests/unit covers the same assignments with the CPU stream executor).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from meshmorph.demos.nets import NETS, build_net, example_input
from meshmorph.streams.assign import assign_streams
from meshmorph.streams.cuda_graph import CudaStreamRunner, ModuleGraph, StreamGraph
from meshmorph.streams.op_graph import build_op_graph
from meshmorph.streams.overlap import trace_overlap

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


class FourBranches(nn.Module):
    """Four independent chains of small matmuls: kernels too small to fill the GPU alone."""

    def __init__(self, depth: int = 24, width: int = 128) -> None:
        super().__init__()
        self.example_input_shape = (width,)
        self.branches = nn.ModuleList(
            nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)]) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b, c, d = (branch(x) for branch in self.branches)
        return a + b + c + d


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(NETS))
def test_multi_stream_graph_replay_equals_eager_on_new_inputs(name: str) -> None:
    torch.manual_seed(0)
    model = build_net(name).cuda().eval()
    x = example_input(model, 2).cuda()
    graph = build_op_graph(model, (x,))
    assignment = assign_streams(graph.dag, graph.order)
    with torch.no_grad():
        _close(CudaStreamRunner(graph, assignment).issue(x), model(x))
        captured = StreamGraph(graph, assignment, (x,))
        for seed in (1, 2):
            new = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).cuda()
            out = captured.replay(new).clone()
            _close(out, model(new))
        assert not torch.equal(out, captured.replay(x))  # replay really reads the new input


@pytest.mark.timeout(300)
def test_multi_stream_graph_with_backward_gives_eager_gradients() -> None:
    # eval: batch-norm statistics fixed, so the graph and eager run the same forward
    model = build_net("inception-stack").cuda().eval()
    x = example_input(model, 2).cuda()
    graph = build_op_graph(model, (x,))
    assignment = assign_streams(graph.dag, graph.order)
    captured = StreamGraph(graph, assignment, (x,), backward=True)
    captured.replay(x)
    torch.cuda.synchronize()
    # the traced module shares the model's parameters; fx keeps their qualified names
    graph_grads = {n: p.grad.clone() for n, p in graph.module.named_parameters()}
    for p in model.parameters():
        p.grad = None
    out = model(x)
    out.backward(torch.ones_like(out))
    eager_grads = dict(model.named_parameters())
    assert set(graph_grads) == set(eager_grads)
    for name, ours in graph_grads.items():
        _close(ours, eager_grads[name].grad)


def _median_replay_s(replay, x: torch.Tensor, repeats: int = 50) -> float:
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        replay(x)
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


@pytest.mark.timeout(300)
def test_multi_stream_kernels_spread_over_streams_and_beat_one_stream(tmp_path: Path) -> None:
    """The kernels land on the assigned streams (profiler trace) and the replay beats one stream
    by wall time. The trace is not asked to show them overlapping: on an H200 (torch 2.11) the
    profiled replay showed 0-19% of kernel time overlapped in six tries while the same replay,
    unprofiled, ran 1.9-2.4x faster than one stream (the tracer serialises graph kernels)."""
    model = FourBranches().cuda().eval()
    x = torch.randn(1, 128, device="cuda")
    graph = build_op_graph(model, (x,))
    assignment = assign_streams(graph.dag, graph.order)
    assert (assignment.width, len(assignment.streams)) == (4, 4)
    with torch.no_grad():
        multi = StreamGraph(graph, assignment, (x,))
        single = ModuleGraph(model, (x,))
        _close(multi.replay(x).clone(), single.replay(x).clone())
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            multi.replay(x)
            torch.cuda.synchronize()
        prof.export_chrome_trace(str(tmp_path / "trace.json"))
        overlap = trace_overlap(tmp_path / "trace.json")
        assert overlap.kernels >= 4 * 24 and overlap.streams >= 4
        assert _median_replay_s(multi.replay, x) < 0.75 * _median_replay_s(single.replay, x)
