"""Free operators (views, getitems) join a neighbour; in-place writes are ordered after readers."""

from __future__ import annotations

import networkx as nx
import torch
from torch import nn

from meshmorph.streams.assign import assign_streams
from meshmorph.streams.executor import StreamExecutor
from meshmorph.streams.fold import fold_free_ops
from meshmorph.streams.op_graph import build_op_graph
from meshmorph.streams.race import schedule_races


class ReadThenWrite(nn.Module):
    """``b`` reads ``a`` before ``relu_`` overwrites it: only a write edge orders the two."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x * 2
        b = a + 1
        a.relu_()
        return a + b


class Views(nn.Module):
    """Two branches over views of one product, flattened before the head."""

    def __init__(self) -> None:
        super().__init__()
        self.left, self.right = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = (x * 3).view(-1, 8)
        return torch.flatten(self.left(y) * self.right(y.t().t()), 1)


def test_in_place_write_is_ordered_after_an_earlier_reader_on_any_assignment() -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    graph = build_op_graph(ReadThenWrite(), (x,))
    assert graph.dag.has_edge("add", "relu_")  # the write edge
    for method in ("width", "nimble"):
        assignment = assign_streams(graph.dag, graph.order, method=method)
        assert schedule_races(graph.dag, assignment) == []
        assert torch.equal(StreamExecutor(graph, assignment)(x), ReadThenWrite()(x))


def test_views_fold_into_their_producer_and_outputs_stay_exact() -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    model = Views()
    unfolded = build_op_graph(model, (x,), fold=False)
    folded = build_op_graph(model, (x,))
    # view, t, t and flatten are free: 8 operators become 4, the two branches stay
    assert (len(unfolded.order), len(folded.order)) == (8, 4)
    assert folded.members["mul"] == ("mul", "view", "t", "t_1")
    assert folded.members["mul_1"] == ("mul_1", "flatten")
    assert assign_streams(folded.dag, folded.order).width == 2
    assert assign_streams(unfolded.dag, unfolded.order).width == 2
    with torch.no_grad():
        out = StreamExecutor(folded, assign_streams(folded.dag, folded.order))(x)
        assert torch.equal(out, model(x))


def test_a_free_source_joins_its_only_reader_and_times_add_up() -> None:
    dag = nx.DiGraph([("view_w", "mm"), ("x", "mm"), ("mm", "out")])
    for op, t in {"view_w": 0.0, "x": 2.0, "mm": 5.0, "out": 1.0}.items():
        dag.nodes[op]["time_s"] = t
    order, members = fold_free_ops(dag, ["view_w", "x", "mm", "out"], free={"view_w", "out"})
    assert order == ["x", "mm"]
    assert members == {"x": ("x",), "mm": ("view_w", "mm", "out")}
    assert list(dag.edges) == [("x", "mm")]
    assert dag.nodes["mm"]["time_s"] == 6.0
