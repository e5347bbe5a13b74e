"""Achieved GEMM throughput by shape and dtype: a roofline with wave quantisation.

A GEMM of M x K by K x N on a GPU with S streaming multiprocessors is cut into
ceil(M / T) * ceil(N / T) output tiles of T x T (CUTLASS's default tensor-core threadblock
tile, T = 128); the tiles run in waves of S, so a last, partly filled wave wastes
1 - tiles / (waves * S) of the machine. The achieved rate is the lower of
ceiling * peak * tiles / (waves * S) (compute bound) and the arithmetic intensity
2MNK / (c (MK + KN + MN)) times HBM bandwidth (memory bound), c the element bytes.

Each layer's GEMMs are read from the ModelSpec's shape (GPT and Llama blocks, the head); FLOPs
no GEMM accounts for (the attention core, a custom model's layers) run at the ceiling, except a
causal flash-attention core: the half of its FLOPs it does, at its own share of the ceiling.
"""

from __future__ import annotations

import math

from meshmorph.spec.gpus import GPUSpec
from meshmorph.spec.model import LayerKind, LayerSpec, ModelSpec


def wave_efficiency(m: int, n: int, tile: int, sms: int) -> float:
    """Share of the SMs' tile slots doing work: tiles / (waves * SMs); 1 without an SM count."""
    if sms <= 0 or tile <= 0:
        return 1.0
    tiles = math.ceil(m / tile) * math.ceil(n / tile)
    return tiles / (math.ceil(tiles / sms) * sms)


def gemm_time(m: int, n: int, k: int, gpu: GPUSpec, dtype: str, element_bytes: float,
              ceiling: float, tile: int, out_bytes: float | None = None) -> float:
    """Seconds of one M x K by K x N GEMM (roofline with wave quantisation); operands of
    ``element_bytes``, the result of ``out_bytes`` (by default the operands')."""
    flops = 2.0 * m * n * k
    compute = gpu.peak_flops(dtype) * ceiling * wave_efficiency(m, n, tile, int(gpu.sm_count))
    out = element_bytes if out_bytes is None else out_bytes
    memory = (element_bytes * (m * k + k * n) + out * m * n) / (gpu.hbm_gbps * 1e9)
    return max(flops / compute, memory)


def layer_gemms(model: ModelSpec, layer: LayerSpec, tp: int) -> tuple[tuple[int, int], ...]:
    """(N, K) of each forward GEMM of one layer on one tensor-parallel rank (M = tokens)."""
    h, f = model.hidden_size, model.ffn_hidden_size
    if layer.kind == LayerKind.HEAD:
        return ((model.padded_vocab_size // tp, h),)
    if layer.kind != LayerKind.BLOCK or model.arch not in ("gpt", "llama"):
        return ()
    kv = h * model.num_kv_heads // model.num_heads
    up = 2 * f if model.arch == "llama" else f  # SwiGLU: gate and up projections
    return (((h + 2 * kv) // tp, h), (h, h // tp), (up // tp, h), (h, f // tp))


def layer_efficiency(model: ModelSpec, layer: LayerSpec, tp: int, tokens: int, gpu: GPUSpec,
                     dtype: str, element_bytes: float, ceiling: float, tile: int,
                     gemm_dtype: str | None = None, attention_efficiency: float = 0.5) -> float:
    """Achieved fraction of ``dtype``'s peak over the layer's forward FLOPs on one TP rank: the
    GEMMs at their roofline rate, the rest at the ceiling (FLOP-weighted harmonic mean); a flash
    attention core (``LayerSpec.flash_attention``) does the causal half of its FLOPs at
    ``attention_efficiency`` times the ceiling (0.5: as if all of them ran at the ceiling). With
    ``gemm_dtype`` ``fp8`` the GEMMs multiply float8 operands (1 byte) into ``element_bytes``
    results at the fp8 peak (cost/fp8.py), so the fraction may pass the ceiling."""
    total = layer.fwd_flops_per_token * tokens / tp
    if total <= 0:
        return ceiling
    peak = gpu.peak_flops(dtype)
    fp8 = gemm_dtype == "fp8"
    seconds, gemm_flops = 0.0, 0.0
    for n, k in layer_gemms(model, layer, tp):
        seconds += gemm_time(tokens, n, k, gpu, gemm_dtype or dtype,
                             1.0 if fp8 else element_bytes, ceiling, tile,
                             out_bytes=element_bytes)
        gemm_flops += 2.0 * tokens * n * k
    rest = max(total - gemm_flops, 0.0)
    if layer.flash_attention:  # the masked half of the scores is skipped, the rest runs slower
        rest = rest / 2 / attention_efficiency
    seconds += rest / (peak * ceiling)
    return total / (peak * seconds)
