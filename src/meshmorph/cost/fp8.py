"""Float8 linear layers (dtype ``fp8``): what torchao's float8 training adds to a block's GEMMs
(docs/cost-model.md, "Float8 linear layers", has what is not priced, the H200 measurements the
casts' bandwidth share comes from and the check against torchtitan's published pair).

Each linear of a transformer block (torchtitan converts those and leaves the output head bf16)
multiplies float8 operands at the GPU's fp8 peak into bf16 results; its operands are scaled and
cast on the fly from the tensors the model keeps. A cast is memory-bound: per element of each
GEMM operand it reads the source tensor for its scale (an absolute maximum), reads it again and
writes float8 in each layout the GEMMs need. Bytes per element, compiled, with s the source's
bytes per element:

================== =============================== ========================== ===========
scaling            input (M x K)                   weight (K x N): fwd + bwd  grad output
================== =============================== ========================== ===========
tensorwise         s amax + s + 1 + 1 = 2s + 2     (2s + 1) + (s + 1)         6
rowwise            (s + 1 + 2) + (2 + 1) = s + 6   (s + 1) + (3s + 1)         8
rowwise_with_gw_hp s + 1 (one layout)              (s + 1) + (s + 1)          3
================== =============================== ========================== ===========

The output gradient is the input's formula at s = 2 (gradients are bf16). Rowwise scales lie
along the GEMM's reduction, so the column-major copy is transposed in bf16 first (the s + 2 and
2 + 1 steps of the input; s + s and s + 1 of the weight's backward); ``rowwise_with_gw_hp`` runs
the weight gradient's GEMM in bf16 and casts each tensor once.

The source is what the runtime holds (``block_linears``; cost/state.py). Where autocast runs
over fp32 parameters (no FSDP2 sharding: ``stream32``) the casts read fp32 weights and, for the
linears fed by a norm (attention's q, k, v; the MLP's first), the norm's fp32 output: s = 4.
Where FSDP2's mixed precision gathers 16-bit parameters, every source is bf16: s = 2. Each
linear casts its own input, as the runtime (and torchtitan) builds them: q, k and v cast the
same input three times, SwiGLU's gate and up twice, although ``cost.gemm.layer_gemms`` prices
their GEMMs merged.

Eager PyTorch runs each step of a cast as its own kernels (abs, max, scale, clamp, convert):
``eager_elementwise_passes / elementwise_passes`` times the bytes. The input's and the weight's
forward casts fall in the forward, the rest in the backward. Gathers and tensor-parallel
collectives stay 16-bit (torchtitan's float8 all-gather options are not priced).

Under tensor parallelism a scale whose reduction runs along a split dim needs the other ranks'
maxima: DTensor all-reduces each such absolute maximum, which torchao upcasts to float64 first
(``tp_amax_elements``). The run's state line counts those bytes (cost/rank_state.py); the step
time does not price them (one small all-reduce per cast: latency, not bandwidth).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshmorph.spec.gpus import GPUSpec

if TYPE_CHECKING:
    from meshmorph.spec.model import ModelSpec

Bytes = tuple[float, float]
"""(reads, extra) of a cast: reads x the source's bytes per element + extra bytes."""

CAST_BYTES: dict[str, tuple[Bytes, Bytes, Bytes, Bytes]] = {
    # scaling: (input, weight in forward, weight in backward, grad output)
    "tensorwise": ((2, 2), (2, 1), (1, 1), (2, 2)),
    "rowwise": ((1, 6), (1, 1), (3, 1), (1, 6)),
    "rowwise_with_gw_hp": ((1, 1), (1, 1), (1, 1), (1, 1)),
}
"""Bytes a compiled cast moves per operand element (the module docstring's table)."""

GRAD_SOURCE_BYTES = 2.0
"""Output gradients reach the casts in bf16 (the 16-bit GEMM results' gradients)."""

Linear = tuple[int, int, bool]
"""(N, K, fed by a norm) of one linear on one tensor-parallel rank (M = tokens)."""


def block_linears(model: ModelSpec, tp: int) -> tuple[Linear, ...]:
    """The linears of one transformer block as run/model/decoder.py builds them (torchtitan's
    too): q, k, v and the output projection; GPT's fc1 and fc2, or Llama's w1, w3 and w2. None
    for other architectures (as ``cost.gemm.layer_gemms``)."""
    if model.arch not in ("gpt", "llama"):
        return ()
    h, f = model.hidden_size, model.ffn_hidden_size
    kv = h * model.num_kv_heads // model.num_heads
    ups = 2 if model.arch == "llama" else 1
    return ((h // tp, h, True), (kv // tp, h, True), (kv // tp, h, True), (h, h // tp, False),
            *((f // tp, h, True),) * ups, (h, f // tp, False))


def saved_input_elements(model: ModelSpec) -> tuple[float, float]:
    """(shared, split) elements per token of the block linears' inputs a compiled block keeps
    for backward: one norm output before attention and one before the MLP (replicated over the
    tensor-parallel ranks, as ``ActivationBytes.shared``), the attention output and the MLP's
    inner activation (split by tp). Under a recipe whose weight-gradient GEMM runs in float8
    (``weight_grad_in_fp8``) torch.compile's partitioner keeps these as float8, 1 byte each
    instead of bf16's 2 (on an H200 gpt3-1.3b at b 8 x 2048 held 5.25 GiB less, exactly this)."""
    if model.arch not in ("gpt", "llama"):
        return 0.0, 0.0
    return 2.0 * model.hidden_size, float(model.hidden_size + model.ffn_hidden_size)


def weight_grad_in_fp8(scaling: str) -> bool:
    """Whether the weight gradient's GEMM multiplies in float8 under ``scaling``."""
    return scaling != "rowwise_with_gw_hp"


def cast_seconds(linears: tuple[Linear, ...], tokens: int, gpu: GPUSpec, scaling: str, *,
                 stream32: bool, bandwidth_efficiency: float,
                 eager_factor: float) -> tuple[float, float]:
    """(forward, backward) seconds of the float8 casts of one layer's ``linears`` (M =
    ``tokens``) on one tensor-parallel rank; ``stream32``: autocast over fp32 parameters, so
    weights and normed inputs are read as fp32 (the module docstring)."""
    into, w_fwd, w_bwd, grad = CAST_BYTES[scaling]
    wide = 4.0 if stream32 else 2.0

    def moved(cast: Bytes, source: float) -> float:
        return cast[0] * source + cast[1]

    fwd = bwd = 0.0
    for n, k, normed in linears:
        fwd += (moved(into, wide if normed else 2.0) * tokens * k
                + moved(w_fwd, wide) * k * n)
        bwd += moved(w_bwd, wide) * k * n + moved(grad, GRAD_SOURCE_BYTES) * tokens * n
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
