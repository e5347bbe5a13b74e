"""Reshape: training state as boxes of logical tensors (Layout), the cheapest way to turn one
Layout into another on the devices still alive (MovePlan) and its predicted time (``moves/``,
pure), and executing it between live engines (``live/``).
"""
