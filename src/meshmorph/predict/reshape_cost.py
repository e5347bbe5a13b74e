"""What continuing on the survivors costs: the move of the training state from the plan on n nodes
to the plan on m nodes, priced by Reshape's own pure move planner (``elastic.moves``:
``layout_of`` -> ``plan_move`` -> ``move_time``), once per change and process.

A change whose MovePlan reads pieces from the checkpoint (pieces only the lost node held: ZeRO
shards, pipeline stages without a replica) cannot keep the work done since that checkpoint, unless
the preemption notice lets the lost node write them first.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshmorph.elastic.moves.layout import layout_of
from meshmorph.elastic.moves.move_plan import plan_move
from meshmorph.elastic.moves.move_time import move_time
from meshmorph.predict.training_job import TrainingJob

_MOVES: dict[tuple[object, ...], ReshapeMove] = {}
"""Moves by (model, cluster, batch, nodes before, nodes after)."""


@dataclass(frozen=True, slots=True)
class ReshapeMove:
    """One change of node count, priced."""

    move_s: float
    """Predicted move time (``elastic.moves.move_time``), seconds."""
    bytes_moved: int
    """Bytes its MovePlan sends or reads."""
    from_checkpoint: bool
    """Some pieces are only on the lost node(s): they come from the checkpoint."""


def reshape_move(job: TrainingJob, nodes_from: int, nodes_to: int) -> ReshapeMove | None:
    """The move from the job's plan on ``nodes_from`` nodes to its plan on ``nodes_to`` (the
    survivors are the first nodes; joining nodes come after); None where either plan is missing."""
    key = (job.model.name, job.model.num_params, repr(job.cluster.groups), job.global_batch,
           job.dtype, nodes_from, nodes_to)
    if key in _MOVES:
        return _MOVES[key]
    plan_a, plan_b = job.plan(nodes_from), job.plan(nodes_to)
    if plan_a is None or plan_b is None:
        return None
    layout_a, layout_b = (layout_of(job.model, p if p.stages else p.with_even_stages(job.model))
                          for p in (plan_a, plan_b))
    per_node = job.gpus_per_node
    move = plan_move(layout_a, layout_b, list(range(min(nodes_from, nodes_to) * per_node)),
                     list(range(nodes_from * per_node, nodes_to * per_node)))
    seconds = move_time(move, job.sub_cluster(max(nodes_from, nodes_to))).total_s
    _MOVES[key] = ReshapeMove(seconds, move.bytes_moved, bool(move.from_checkpoint))
    return _MOVES[key]
