"""Reshape: training state as boxes of logical tensors (Layout), the cheapest way to turn one
Layout into another on the devices still alive (MovePlan), and its predicted time.

``layout.py`` and ``move_plan.py`` are pure (no torch); executing a MovePlan between live
engines lives beside them.
"""

from meshmorph.elastic.box import Box
from meshmorph.elastic.layout import Layout, Piece, StateTensor, layout_of

__all__ = ["Box", "Layout", "Piece", "StateTensor", "layout_of"]
