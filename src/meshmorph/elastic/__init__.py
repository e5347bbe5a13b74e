"""Reshape: training state as boxes of logical tensors (Layout), the cheapest way to turn one
Layout into another on the devices still alive (MovePlan), and its predicted time.

``layout.py``, ``placement.py`` and ``move_plan.py`` are pure (no torch); executing a MovePlan
between live engines lives beside them.
"""

from meshmorph.elastic.moves.box import Box
from meshmorph.elastic.moves.layout import Layout, Piece, StateTensor, layout_of
from meshmorph.elastic.moves.move_plan import FROM_CHECKPOINT, Batch, MovePlan, Transfer, plan_move
from meshmorph.elastic.moves.placement import ReshapeError

__all__ = ["FROM_CHECKPOINT", "Batch", "Box", "Layout", "MovePlan", "Piece", "ReshapeError",
           "StateTensor", "Transfer", "layout_of", "plan_move"]
