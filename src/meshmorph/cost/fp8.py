"""Float8 linear layers (dtype ``fp8``): what torchao's float8 training adds to a block's GEMMs.

Each ``nn.Linear`` of a transformer block becomes a float8 linear (torchtitan converts every
block linear and leaves the output head in bf16). Its three GEMMs (output, input gradient,
weight gradient) multiply float8 operands at the GPU's fp8 peak and write bf16 results; the
operands are scaled and cast on the fly from the bf16 tensors, which stay what the model keeps.
A cast is memory-bound: per element of each GEMM operand it reads the bf16 tensor for its
scale (an absolute-max reduction), reads it again and writes the float8 copy in each layout the
GEMMs need (row- and column-major). Bytes per element, compiled (inductor fuses each step):

================== ============================ ================ ======================
scaling            input (M x K)                weight (K x N)   grad output (M x N)
================== ============================ ================ ======================
tensorwise         2 amax + 2 + 1 + 1 = 6       2 + 3 + 3 = 8    6 (as the input)
rowwise            (2 + 1 + 2) + (2 + 1) = 8    3 + 4 + 3 = 10   8 (as the input)
rowwise_with_gw_hp 3 (one layout)               3 + 3 = 6        3 (one layout)
================== ============================ ================ ======================

Rowwise scales lie along the GEMM's reduction, so the column-major copy is transposed in bf16
first (the 2 + 2 and 2 + 1 steps); ``rowwise_with_gw_hp`` runs the weight gradient's GEMM in
bf16 and casts each tensor once. Eager PyTorch runs each step of a cast as its own kernels
(abs, max, scale, clamp, convert): ``eager_elementwise_passes / elementwise_passes`` times the
bytes. The input's and the weight's forward casts fall in the forward, the rest in the backward.
GEMMs merged in ``cost.gemm.layer_gemms`` (QKV; SwiGLU's gate and up) cast their shared input
once. Gathers and tensor-parallel collectives stay 16-bit (torchtitan's float8 all-gather
options are not priced).
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
