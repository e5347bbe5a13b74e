"""Cost-aware cap on the number of streams: merge short streams by estimated operator times.

Each stream beyond the cap costs an event pair per cross edge and a hardware queue, and streams
whose operators take microseconds buy no overlap. While there are more than ``max_streams``
streams, the one with the least total time is merged into the stream that gives the smallest
simulated makespan; a merged stream runs its operators in issue order, which keeps every stream a
chain of the DAG's order, so no dependency can be broken (only serialised).
"""

from __future__ import annotations

import networkx as nx


def _time_s(dag: nx.DiGraph, op: str) -> float:
    return float(dag.nodes[op].get("time_s", 1.0))


def makespan_s(dag: nx.DiGraph, order: list[str], streams: list[list[str]]) -> float:
    """Finish time of the last operator when every stream runs at once and each operator starts
    after its stream's previous operator and all its parents: start = max(stream free, parents)."""
    stream_of = {op: s for s, ops in enumerate(streams) for op in ops}
    free = [0.0] * len(streams)
    finish: dict[str, float] = {}
    for op in order:
        s = stream_of[op]
        start = max([free[s], *(finish[p] for p in dag.predecessors(op))])
        finish[op] = free[s] = start + _time_s(dag, op)
    return max(finish.values(), default=0.0)


def merge_streams(dag: nx.DiGraph, order: list[str], streams: list[list[str]],
                  max_streams: int) -> list[list[str]]:
    """Merge streams until at most ``max_streams`` remain; streams keep issue order inside."""
    if max_streams < 1:
        raise ValueError(f"max_streams must be at least 1, got {max_streams}")
    position = {op: i for i, op in enumerate(order)}
    merged = [list(s) for s in streams]
    while len(merged) > max_streams:
        totals = [sum(_time_s(dag, op) for op in s) for s in merged]
        shortest = min(range(len(merged)), key=lambda i: (totals[i], i))
        candidates: dict[int, list[list[str]]] = {}  # target -> the shortest merged into it
        for target in range(len(merged)):
            if target != shortest:
                union = sorted(merged[target] + merged[shortest], key=position.__getitem__)
                candidates[target] = [union if i == target else s
                                      for i, s in enumerate(merged) if i != shortest]
        target = min(candidates,
                     key=lambda t: (makespan_s(dag, order, candidates[t]), totals[t], t))
        merged = candidates[target]
    merged.sort(key=lambda s: position[s[0]])
    return merged
