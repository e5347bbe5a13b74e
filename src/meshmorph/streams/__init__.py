"""Inside one device: the operator DAG of a module, its streams, and their execution.

op_graph (fx trace, operator times) -> assign (Nimble's matching; width streams, fewest syncs) ->
cap (at most K streams) -> executor (CPU, in stream order, checked by race) or cuda_graph
(CUDA streams and events captured into a CUDA graph). Needs only torch (and spec/ for factories).
"""
