"""Float8 linear layers (dtype ``fp8``): what torchao's float8 training adds to a block's GEMMs
(docs/cost-model.md, "Float8 linear layers", has what is not priced and the check against
torchtitan's published pair).

Each linear of a transformer block (torchtitan converts those and leaves the output head bf16)
multiplies float8 operands at the GPU's fp8 peak into bf16 results; its operands are scaled and
cast on the fly from the bf16 tensors the model keeps. A cast is memory-bound: per element of each
GEMM operand it reads the bf16 tensor for its scale (an absolute maximum), reads it again and
writes float8 in each layout the GEMMs need. Bytes per element, compiled:

================== ============================ ================ ======================
scaling            input (M x K)                weight (K x N)   grad output (M x N)
================== ============================ ================ ======================
tensorwise         2 amax + 2 + 1 + 1 = 6       2 + 3 + 3 = 8    6 (as the input)
rowwise            (2 + 1 + 2) + (2 + 1) = 8    3 + 4 + 3 = 10   8 (as the input)
rowwise_with_gw_hp 3 (one layout)               3 + 3 = 6        3 (one layout)
================== ============================ ================ ======================

Rowwise scales lie along the GEMM's reduction, so the column-major copy is transposed in bf16
first; ``rowwise_with_gw_hp`` runs the weight gradient's GEMM in bf16 and casts each tensor once.
Eager kernels move ``eager_elementwise_passes / elementwise_passes`` times the bytes. The input's
and the weight's forward casts fall in the forward, the rest in the backward.
"""

from __future__ import annotations

from meshmorph.spec.gpus import GPUSpec

CAST_BYTES: dict[str, tuple[float, float, float, float]] = {
    # scaling: (input, weight in forward, weight in backward, grad output) bytes per element
    "tensorwise": (6.0, 5.0, 3.0, 6.0),
    "rowwise": (8.0, 3.0, 7.0, 8.0),
    "rowwise_with_gw_hp": (3.0, 3.0, 3.0, 3.0),
}
"""Bytes a compiled cast moves per operand element (the module docstring's table)."""


def weight_grad_in_fp8(scaling: str) -> bool:
    """Whether the weight gradient's GEMM multiplies in float8 under ``scaling``."""
    return scaling != "rowwise_with_gw_hp"


def cast_seconds(gemms: tuple[tuple[int, int], ...], tokens: int, gpu: GPUSpec, scaling: str,
                 *, bandwidth_efficiency: float, eager_factor: float) -> tuple[float, float]:
    """(forward, backward) seconds of the float8 casts of one layer's GEMMs ((N, K) each, M =
    ``tokens``) on one tensor-parallel rank."""
    into, w_fwd, w_bwd, grad = CAST_BYTES[scaling]
    fwd = sum(into * tokens * k + w_fwd * k * n for n, k in gemms)
    bwd = sum(w_bwd * k * n + grad * tokens * n for n, k in gemms)
    rate = gpu.hbm_gbps * 1e9 * bandwidth_efficiency / eager_factor
    return fwd / rate, bwd / rate
