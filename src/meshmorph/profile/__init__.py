"""Measuring the local devices: GEMM FLOP/s, collectives (alpha-beta), per-layer forward and
backward times and the optimizer step, written as a ``meshmorph.cost.Profile`` (``meshmorph
profile``). Modules here import torch; the cost model only reads the Profile file."""
