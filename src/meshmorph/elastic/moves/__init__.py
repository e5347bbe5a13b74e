"""Pure move planning (no torch): Layout, boxes, placement, MovePlan, its predicted time and the
choice of the next Plan."""
