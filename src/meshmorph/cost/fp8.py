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
first (the 2 + 2 and 2 + 1 steps); ``rowwise_with_gw_hp`` runs the weight gradient's GEMM in
bf16 and casts each tensor once. Eager PyTorch runs each step of a cast as its own kernels
(abs, max, scale, clamp, convert): ``eager_elementwise_passes / elementwise_passes`` times the
bytes. The input's and the weight's forward casts fall in the forward, the rest in the backward.
GEMMs merged in ``cost.gemm.layer_gemms`` (QKV; SwiGLU's gate and up) cast their shared input
once. Gathers and tensor-parallel collectives stay 16-bit (torchtitan's float8 all-gather
options are not priced).

Under tensor parallelism a scale whose reduction runs along a split dim needs the other ranks'
maxima: DTensor all-reduces each such absolute maximum, which torchao upcasts to float64 first
(``tp_amax_elements``). The run's state line counts those bytes (cost/rank_state.py); the step
time does not price them (one small all-reduce per cast: latency, not bandwidth).
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


AMAX_BYTES = 8
"""Bytes of one absolute maximum as DTensor all-reduces it (torchao upcasts it to float64)."""


def tp_amax_elements(scaling: str, *, tokens: int, hidden: int, column: int, row: int,
                     replays: int = 1) -> int:
    """Absolute-maximum elements one transformer block all-reduces over its tensor-parallel
    group per micro-batch of ``tokens`` tokens (b s), as torchao's casts run on DTensors split
    as run/parallel/parallelize.py splits them: ``column`` column-parallel linears (weight
    Shard(0), K = ``hidden``, output split by columns) and ``row`` row-parallel ones (weight
    Shard(1), input split along K, N = ``hidden``); ``replays``: forwards per micro-batch (2
    under full recompute). Per linear, (forward, backward):

    ================== ================================ ===========================
    scaling            column-parallel                  row-parallel
    ================== ================================ ===========================
    tensorwise         (1, 3): weight; weight, grad     (2, 2): weight, input;
                       output twice                     weight, input
    rowwise            (0, tokens + K): grad output     (tokens + N, 0): input per
                       per token, weight per K row      token, weight per N column
    rowwise_with_gw_hp (0, tokens + 1): grad output     (tokens + N, 1): as rowwise;
                       per token, weight (tensorwise)   weight (tensorwise)
    ================== ================================ ===========================

    A replicated operand (a column-parallel layer's input, a row-parallel layer's output
    gradient) or a reduction along an unsplit dim needs none."""
    column_fb, row_fb = {
        "tensorwise": ((1, 3), (2, 2)),
        "rowwise": ((0, tokens + hidden), (tokens + hidden, 0)),
        "rowwise_with_gw_hp": ((0, tokens + 1), (tokens + hidden, 1)),
    }[scaling]
    return (column * (replays * column_fb[0] + column_fb[1])
            + row * (replays * row_fb[0] + row_fb[1]))
