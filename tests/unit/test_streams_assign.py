"""Stream assignment: width streams (checked independently), fewest syncs (checked by brute force).

Terms. A *chain partition* splits the operators into streams, each totally ordered by the DAG
(any two of its operators joined by a path), run in topological order. Its *syncs* are the edges of
the transitive reduction G' whose two ends are on different streams (the events a run needs).
"""

from __future__ import annotations

import random

import networkx as nx
from hypothesis import given, settings
from hypothesis import strategies as st

from meshmorph.streams.assign import assign_streams, width


def fewest_syncs_by_stream_count(dag: nx.DiGraph) -> dict[int, int]:
    """Brute force over every chain partition: stream count -> fewest syncs with that many streams.

    Each operator, in topological order, goes after the last operator of an existing stream that
    precedes it in the DAG's order, or opens a new stream; this enumerates every chain partition
    once. Syncs = |E(G')| - (edges of G' joining consecutive operators of a stream), because two
    operators of one stream joined by an edge of G' are always consecutive on it.
    """
    order = list(nx.topological_sort(dag))
    closure = nx.transitive_closure_dag(dag)
    reduced = nx.transitive_reduction(dag)
    kept: dict[int, int] = {}  # stream count -> most reduced edges inside streams

    def extend(i: int, lasts: list[str], inside: int) -> None:
        if i == len(order):
            kept[len(lasts)] = max(kept.get(len(lasts), -1), inside)
            return
        op = order[i]
        for k, last in enumerate(lasts):
            if closure.has_edge(last, op):
                lasts[k] = op
                extend(i + 1, lasts, inside + reduced.has_edge(last, op))
                lasts[k] = last
        lasts.append(op)
        extend(i + 1, lasts, inside)
        lasts.pop()

    extend(0, [], 0)
    edges = reduced.number_of_edges()
    return {count: edges - inside for count, inside in kept.items()}


def max_antichain_size(dag: nx.DiGraph) -> int:
    """Independent of matching: enumerate every antichain (networkx) and take the largest."""
    return max(len(a) for a in nx.antichains(dag))


def random_dag(rng: random.Random, n: int, p: float) -> nx.DiGraph:
    dag = nx.DiGraph()
    dag.add_nodes_from(f"op{i}" for i in range(n))
    dag.add_edges_from((f"op{i}", f"op{j}") for i in range(n) for j in range(i + 1, n)
                       if rng.random() < p)
    return dag


def series_parallel(tree: object, dag: nx.DiGraph) -> tuple[list[str], list[str]]:
    """Add a vertex series-parallel graph to ``dag``: a leaf is one operator; ("S", parts) joins
    every sink of a part to every source of the next; ("P", parts) puts the parts side by side."""
    if tree == "op":
        name = f"op{dag.number_of_nodes()}"
        dag.add_node(name)
        return [name], [name]
    kind, parts = tree  # type: ignore[misc]
    built = [series_parallel(part, dag) for part in parts]
    if kind == "P":
        return [s for b in built for s in b[0]], [t for b in built for t in b[1]]
    for (_, sinks), (sources, _) in zip(built, built[1:], strict=False):
        dag.add_edges_from((u, v) for u in sinks for v in sources)
    return built[0][0], built[-1][1]


SP_TREES = st.recursive(
    st.just("op"),
    lambda parts: st.tuples(st.sampled_from(["S", "P"]), st.lists(parts, min_size=2, max_size=3)),
    max_leaves=12)


@settings(max_examples=60, deadline=None)
@given(SP_TREES)
def test_streams_equal_width_with_fewest_syncs_on_random_series_parallel_graphs(tree: object) -> None:
    dag: nx.DiGraph = nx.DiGraph()
    series_parallel(tree, dag)
    assignment = assign_streams(dag)
    expected = max_antichain_size(dag)
    assert assignment.width == width(dag) == expected
    assert len(assignment.streams) == expected
    assert sorted(op for s in assignment.streams for op in s) == sorted(dag)
    # and the fewest syncs of any width-stream assignment (brute force, see below)
    assert len(assignment.syncs) == fewest_syncs_by_stream_count(dag)[expected]


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 9), st.floats(0.05, 0.6), st.integers(0, 2**31))
def test_width_equals_largest_antichain_on_random_dags(n: int, p: float, seed: int) -> None:
    dag = random_dag(random.Random(seed), n, p)
    assert width(dag) == max_antichain_size(dag)
    assert len(assign_streams(dag).streams) == max_antichain_size(dag)


def test_sync_counts_equal_brute_force_minimum_on_graphs_up_to_10_nodes() -> None:
    """Two minima, each over every chain partition of the DAG (``fewest_syncs_by_stream_count``):

    * method="width" minimises syncs over the chain partitions with exactly width(G) streams:
      len(syncs) == min{(syncs of P) : P a chain partition, |P| = width};
    * method="nimble" is Nimble's claim, the minimum over chain partitions of ANY size:
      len(syncs) == min{(syncs of P) : P a chain partition} = |E(G')| - nu(B(G')).
    """
    rng = random.Random(12)
    for trial in range(120):
        n = rng.randint(3, 10) if trial % 3 else 10
        dag = random_dag(rng, n, rng.uniform(0.1, 0.5))
        fewest = fewest_syncs_by_stream_count(dag)
        w = max_antichain_size(dag)
        assert min(fewest) == w  # Dilworth, by brute force
        best_any, best_width = min(fewest.values()), fewest[w]
        ours, nimble = assign_streams(dag), assign_streams(dag, method="nimble")
        assert (len(ours.streams), len(ours.syncs)) == (w, best_width), trial
        assert len(nimble.syncs) == best_any, trial
        assert len(nimble.streams) >= w


def test_nimble_needs_a_third_stream_where_width_is_two() -> None:
    """a, b -> c -> d, e: width 2, but the reduction (the graph itself) has no 2-path cover."""
    dag = nx.DiGraph([("a", "c"), ("b", "c"), ("c", "d"), ("c", "e")])
    nimble, ours = assign_streams(dag, method="nimble"), assign_streams(dag)
    assert (len(nimble.streams), len(nimble.syncs)) == (3, 2)
    assert (len(ours.streams), len(ours.syncs)) == (2, 2)
    # one stream continues past c's other branch through a closure edge that is not in the DAG
    pairs = {pair for s in ours.streams for pair in zip(s, s[1:], strict=False)}
    assert len(pairs - set(dag.edges)) == 1
    assert next(iter(pairs - set(dag.edges)))[1] in ("d", "e")


def test_max_streams_caps_the_count_and_keeps_every_operator_once() -> None:
    dag = nx.DiGraph([("s", x) for x in "abcd"] + [(x, "t") for x in "abcd"])
    for node, time_s in zip("sabcdt", [1, 5, 1, 1, 4, 1], strict=True):
        dag.nodes[node]["time_s"] = time_s
    capped = assign_streams(dag, max_streams=2)
    assert (capped.width, len(capped.streams)) == (4, 2)
    assert sorted(op for s in capped.streams for op in s) == sorted("sabcdt")
    # the two long branches (5 and 4) end up on different streams
    stream_of = capped.stream_of
    assert stream_of["a"] != stream_of["d"]
    assert capped.method == "width+cap 2"
