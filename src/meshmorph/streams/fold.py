"""Operators that cost nothing are folded into a neighbour, and in-place writes get order edges.

*Free* operators launch no kernel: views (their output shares an input's storage, no FLOPs) and
``getitem`` on a tuple output. Each would otherwise count as an operator of its own, raising the
width with streams that do nothing (a training step's ``t(weight)`` and batch-norm ``getitem``s).
In program order, a free operator with exactly one parent operator joins that parent's group (it
runs right after it); one with no parent operator and exactly one reader joins the reader's group
(it runs right before it). Neither contraction can close a cycle: the first would need a path
from the free operator back to its only parent, the second a path into an operator with none.

*In-place* operators (an input's version counter moved while the operator ran) write memory that
other operators read, which the data edges alone do not order: every other reader of the written
input that comes earlier in program order gets an edge to the writer, every later one an edge
from it. Writes through a second view of the same memory are not tracked.
"""

from __future__ import annotations

import networkx as nx


def add_write_edges(dag: nx.DiGraph, order: list[str], writes: dict[str, list[list[str]]]) -> None:
    """For writer w and each input it wrote, order w against that input's other readers."""
    position = {op: i for i, op in enumerate(order)}
    for writer, readers_per_input in writes.items():
        for readers in readers_per_input:
            for reader in readers:
                if reader == writer or reader not in position:
                    continue
                if position[reader] < position[writer]:
                    dag.add_edge(reader, writer)
                else:
                    dag.add_edge(writer, reader)


def fold_free_ops(dag: nx.DiGraph, order: list[str],
                  free: set[str]) -> tuple[list[str], dict[str, tuple[str, ...]]]:
    """Contract free operators into a neighbour, in place; returns the remaining order and, for each
    remaining operator, the operators it runs, in order. ``time_s`` and ``flops`` add up."""
    members: dict[str, list[str]] = {op: [op] for op in order}
    for op in order:
        if op not in free:
            continue
        parents = list(dag.predecessors(op))
        if len(parents) == 1:
            target = parents[0]
            members[target] = members[target] + members.pop(op)
        elif not parents and dag.out_degree(op) == 1:
            target = next(iter(dag.successors(op)))
            members[target] = members.pop(op) + members[target]
        else:
            continue
        for key in ("time_s", "flops"):
            dag.nodes[target][key] = dag.nodes[target].get(key, 0) + dag.nodes[op].get(key, 0)
        dag.add_edges_from((target, s) for s in dag.successors(op) if s != target)
        dag.add_edges_from((p, target) for p in dag.predecessors(op) if p != target)
        dag.remove_node(op)
    remaining = [op for op in order if op in members]
    return remaining, {op: tuple(members[op]) for op in remaining}
