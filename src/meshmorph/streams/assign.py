"""Stream assignment: which operator runs on which stream, and which edges need an event.

Nimble (Kwon et al., NeurIPS 2020) takes the transitive reduction G' of the operator DAG, builds the
bipartite graph with an edge (u_out, v_in) for every edge u -> v of G', and finds a maximum
matching M; a matched edge puts v right after u on u's stream, so the streams are the paths of a
minimum path cover of G'. Its two claims, and what they do and do not say:

* **Maximum logical concurrency**: no two independent operators (no path between them) share a
  stream. Every chain partition has this property, Nimble's included.
* **Fewest synchronisations**: an event is needed exactly for the edges of G' whose ends are on
  different streams (two operators of one stream joined by an edge of G' are always adjacent on
  it, so those edges form a matching). Hence syncs >= |E(G')| - nu(B(G')), and Nimble reaches it.

What Nimble does not give is the fewest streams: a path cover of G' may need more paths than the
width of the DAG (the largest set of pairwise independent operators). Dilworth's theorem needs
chains of the partial order, i.e. paths of the transitive CLOSURE, whose minimum cover has exactly
``width`` chains (Fulkerson: n - maximum matching of the closure's bipartite graph). Example:
a, b -> c -> d, e has width 2, but G' = G has no path cover with fewer than 3 paths.

``method="width"`` (the default) matches on the closure with weight ``n + 1`` per edge plus 1 when
the edge is in G' (a maximum-weight matching, scipy's ``linear_sum_assignment``): the largest
matching first, so exactly ``width`` streams, then the most edges of G' inside streams, so the
fewest syncs among all width-stream assignments. ``method="nimble"`` is Nimble's algorithm as
published (``networkx`` Hopcroft-Karp on G'). ``max_streams`` caps the count (see cap.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import networkx as nx
import numpy as np
from scipy.optimize import linear_sum_assignment

Method = Literal["width", "nimble"]
Edge = tuple[str, str]


@dataclass(frozen=True, slots=True)
class StreamAssignment:
    """Operators split into streams, each run in order, with the events between streams."""

    order: tuple[str, ...]
    """Every operator, in the order they are issued (a topological order of the DAG)."""
    reduced_edges: tuple[Edge, ...]
    """Edges of the transitive reduction of the DAG, in issue order of their heads."""
    streams: tuple[tuple[str, ...], ...]
    """The operators of each stream, in the order that stream runs them."""
    syncs: tuple[Edge, ...]
    """Edges (u, v) with u and v on different streams: v's stream waits on an event u records."""
    width: int
    """Largest set of pairwise independent operators (the minimum number of streams)."""
    method: str
    """How the streams were found: width, nimble, and '+cap K' when capped at K streams."""

    @property
    def stream_of(self) -> dict[str, int]:
        """Operator -> its stream's index."""
        return {op: s for s, ops in enumerate(self.streams) for op in ops}

    @property
    def waits(self) -> dict[str, list[str]]:
        """Operator -> the sync parents whose events its stream waits on first."""
        waits: dict[str, list[str]] = {}
        for u, v in self.syncs:
            waits.setdefault(v, []).append(u)
        return waits


def happens_before(ops: Iterable[str], streams: Sequence[Sequence[str]],
                   syncs: Sequence[Edge]) -> nx.DiGraph:
    """The order every run keeps: each stream's own order plus the synced cross-stream edges."""
    graph: nx.DiGraph = nx.DiGraph(list(syncs))
    graph.add_nodes_from(ops)
    for stream in streams:
        graph.add_edges_from(zip(stream, stream[1:], strict=False))
    return graph


def topological_order(dag: nx.DiGraph, order: list[str] | None = None) -> list[str]:
    """``order`` if it is a topological order of ``dag``, else networkx's lexicographic one."""
    if order is not None:
        position = {op: i for i, op in enumerate(order)}
        if len(position) == dag.number_of_nodes() and all(
                op in position for op in dag) and all(position[u] < position[v] for u, v in dag.edges):
            return list(order)
        raise ValueError("order is not a topological order of the DAG's operators; pass None to "
                         "let networkx choose one")
    if not nx.is_directed_acyclic_graph(dag):
        raise ValueError("the operator graph has a cycle; streams need a DAG")
    return list(nx.lexicographical_topological_sort(dag))


def _bipartite_matching(edges: list[Edge], nodes: list[str]) -> dict[str, str]:
    """Maximum matching of the bipartite graph (u_out, v_in) for u -> v: successor of each u."""
    bip: nx.Graph = nx.Graph()
    tops = [("out", u) for u in nodes]
    bip.add_nodes_from(tops)
    bip.add_nodes_from(("in", v) for v in nodes)
    bip.add_edges_from((("out", u), ("in", v)) for u, v in edges)
    matching = nx.bipartite.hopcroft_karp_matching(bip, top_nodes=tops)
    return {u[1]: v[1] for u, v in matching.items() if u[0] == "out"}


def width(dag: nx.DiGraph) -> int:
    """Size of a largest antichain = n - maximum matching of the closure's bipartite graph."""
    closure = nx.transitive_closure_dag(dag)
    return dag.number_of_nodes() - len(_bipartite_matching(list(closure.edges), list(dag)))


def _weighted_matching(dag: nx.DiGraph, reduced: nx.DiGraph, order: list[str]) -> dict[str, str]:
    """Largest matching of the closure, then most reduced edges (lexicographic weights)."""
    n = len(order)
    index = {op: i for i, op in enumerate(order)}
    weight = np.zeros((n, n))
    for u, v in nx.transitive_closure_dag(dag).edges:
        weight[index[u], index[v]] = n + 1 + (1 if reduced.has_edge(u, v) else 0)
    rows, cols = linear_sum_assignment(weight, maximize=True)
    return {order[r]: order[c] for r, c in zip(rows, cols, strict=True) if weight[r, c] > 0}


def chains_from_matching(order: list[str], successor: dict[str, str]) -> list[list[str]]:
    """Follow matched successors from every unmatched head; streams sorted by their head's order."""
    heads = set(order) - set(successor.values())
    chains = []
    for op in order:
        if op in heads:
            chain = [op]
            while chain[-1] in successor:
                chain.append(successor[chain[-1]])
            chains.append(chain)
    return chains


def needed_syncs(streams: list[list[str]], reduced_edges: list[Edge]) -> list[Edge]:
    """Reduced edges across streams that stream order plus the other syncs do not already imply.

    Uncapped, every cross-stream reduced edge is needed (a second path would contradict the
    reduction); after merging streams some become implied and are dropped.
    """
    stream_of = {op: s for s, ops in enumerate(streams) for op in ops}
    cross = [(u, v) for u, v in reduced_edges if stream_of[u] != stream_of[v]]
    kept = nx.transitive_reduction(happens_before(stream_of, streams, cross))
    return [e for e in cross if kept.has_edge(*e)]


def assign_streams(dag: nx.DiGraph, order: list[str] | None = None, *, method: Method = "width",
                   max_streams: int | None = None) -> StreamAssignment:
    """Streams for the operators of ``dag`` (node attribute ``time_s`` prices a capped merge)."""
    if dag.number_of_nodes() == 0:
        raise ValueError("the operator graph is empty; the module has no operators to assign")
    if max_streams is not None and max_streams < 1:
        raise ValueError(f"max_streams must be at least 1, got {max_streams}")
    order = topological_order(dag, order)
    reduced = nx.transitive_reduction(dag)
    position = {op: i for i, op in enumerate(order)}
    reduced_edges = sorted(reduced.edges, key=lambda e: (position[e[1]], position[e[0]]))
    if method == "nimble":
        successor = _bipartite_matching(reduced_edges, order)
    elif method == "width":
        successor = _weighted_matching(dag, reduced, order)
    else:
        raise ValueError(f"method must be 'width' or 'nimble', got {method!r}")
    streams = chains_from_matching(order, successor)
    label = method
    if max_streams is not None and len(streams) > max_streams:
        from meshmorph.streams.cap import merge_streams

        streams = merge_streams(dag, order, streams, max_streams)
        label = f"{method}+cap {max_streams}"
    return StreamAssignment(
        order=tuple(order), reduced_edges=tuple(reduced_edges),
        streams=tuple(tuple(s) for s in streams),
        syncs=tuple(needed_syncs(streams, reduced_edges)), width=width(dag), method=label)
