"""The few coefficients of the cost model, shared by every estimate.

The three fitted ones (matmul_efficiency, elementwise_passes, link_efficiency) are least-squares
fits, rounded, over the 32 published Megatron-LM runs (Narayanan et al. 2021 Table 1, the
Megatron-LM README tables of 2020-09 and 2021-01); ``python bench/calibrate.py`` refits them
with torchtitan's runs over 46 and reports in-sample and leave-one-out error. They are used
unchanged for every GPU; see docs/cost-model.md for the source
of every coefficient. A Profile measured on real hardware overrides them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class CostCoefficients:
    """Achieved fractions of peak and the overlap each kind of communication gets."""

    matmul_efficiency: float = 0.63
    """Fraction of dense peak FLOP/s a large transformer GEMM reaches (the curve's ceiling)."""
    efficiency_half_width: float = 0.0
    """Per-GPU GEMM width (h / tp) at which efficiency falls to half its ceiling; models the
    drop of small, thin matmuls: eff = ceiling * w / (w + half_width). 0 (default): off, the
    GEMM roofline with wave quantisation (cost/gemm.py) prices shape instead."""
    efficiency_half_tokens: float = 0.0
    """Tokens per micro-batch (b * s) at which efficiency halves (small micro-batches); 0: off."""
    elementwise_passes: float = 4.0
    """HBM passes over a layer's saved activations per forward + backward (memory-bound kernels:
    LayerNorm, dropout, GeLU, softmax, residual adds, bias). Time = passes * activation bytes per
    token (no recompute, this rank's share) * tokens / HBM bandwidth; a third in forward (it
    writes them), two thirds in backward (reads them, writes their gradients), a recomputed
    forward repeats the forward's third. Physically about 3."""
    eager_elementwise_passes: float = 12.0
    """``elementwise_passes`` of a run whose memory-bound ops each run as their own kernels
    (eager PyTorch Llama: RMSNorm's fp32 upcast, power, mean, rsqrt and scale, RoPE's complex
    products, SiLU and the gate product, about 12 passes over the saved activations); the fused
    kernels of Megatron-LM and of torch.compile make ``elementwise_passes``. Calibration prices
    the published runs that state eager execution with it."""
    loss_bandwidth_efficiency: float = 0.5
    """Fraction of HBM bandwidth the loss's memory-bound kernels reach over the logits (the
    fp32 log-softmax forward and backward, nll's gradient, the cast back to the logits' dtype:
    ``cost.layer_cost.loss_bytes_per_logit``): on an H200 (torch 2.11) they moved those bytes at
    about 2.4 TB/s of the 4.8 nominal (bench/results/gpu_suite.json, kernel time by kind)."""
    fp8_cast_bandwidth_efficiency: float = 0.5
    """Fraction of HBM bandwidth the float8 casts of dtype ``fp8`` reach over 16-bit sources,
    where FSDP2's mixed precision gathers bf16 parameters (absolute-max reductions and scaled
    conversions over each GEMM operand, cost/fp8.py): taken equal to
    ``loss_bandwidth_efficiency``, the share measured here for compiled memory-bound kernels with
    reductions, and checked against torchtitan's published float8 pair (FSDP2, Llama 3 8B; it
    gives 1.11-1.15x for rowwise against 1.115x measured); torchao's roofline assumes 0.92."""
    fp8_autocast_cast_bandwidth_efficiency: float = 0.33
    """The same share where autocast runs over fp32 parameters (no FSDP2 sharding: the casts
    read fp32 weights and normed inputs, cost/fp8.py): on an H200 (torch 2.11, torchao 0.17,
    compiled blocks) the least-squares fit of five measured fp8 steps, gpt3-1.3b and a Llama 3
    8B shape under tensorwise, rowwise and rowwise_with_gw_hp (bench/results/gpu_fp8.json);
    each within 3.4% of its measured step. At 0.5 those steps came out 4-13% fast."""
    flash_attention_efficiency: float = 0.44
    """Share of the GEMM ceiling a causal flash-attention kernel reaches, the FLOPs of the causal
    half counted and its backward priced at twice its forward (as every layer's): on an H200
    (torch 2.11, cuDNN's sm90 flash kernels) 348 TFLOP/s of attention beside about 780 of GEMMs
    (bench/results/gpu_suite.json, kernel time by kind, gpt3-1.3b: heads of 128). Heads of 64
    ran at 0.33 (llama3.2-1b); the share is one figure per GPU, not by shape.
    ``gpu_flash_attention_efficiency`` holds other parts."""
    gpu_flash_attention_efficiency: tuple[tuple[str, float], ...] = (
        ("a100-40g", 0.65), ("a100-80g", 0.65))
    """(GPU name, share) pairs that replace ``flash_attention_efficiency``: on the A100,
    FlashAttention-2 (the kernel torch's SDPA runs there) reaches 50-73% of the peak, close to
    its GEMMs (Dao 2023, arXiv 2307.08691): about 0.6 of the peak with its backward counted at
    2.5x its forward, 0.52 at the 2x this model counts, over a GEMM rate of about 0.8."""
    gpu_matmul_efficiency: tuple[tuple[str, float], ...] = ()
    """(GPU name, ceiling) pairs that replace ``matmul_efficiency`` for those GPUs: a part whose
    sustained clock is not its data sheet's (a power limit below the board's rating) reaches its
    own share of the nominal peak. A Profile's measured ceiling still wins."""
    gemm_tile: int = 128
    """Output tile edge of a tensor-core GEMM threadblock (CUTLASS's default 128 x 128); with the
    GPU's SM count it sets the wave quantisation of each GEMM (cost/gemm.py)."""
    link_efficiency: float = 0.9
    """Achieved fraction of a link's nominal bandwidth for large collectives."""
    dp_overlap: float = 1.0
    """Largest share of the data-parallel gradient reduction hidden behind the last backward
    when the plan's ``overlap_grad_reduce`` is on (1: all of it but the last bucket, as far as
    the backward lasts); off, none hides."""
    zero3_overlap: float = 0.8
    """Share of ZeRO-3/FSDP per-micro-batch traffic hidden behind compute: the parameter
    all-gathers when the plan's ``fsdp_prefetch`` is on, the gradient reduce-scatters when its
    ``overlap_grad_reduce`` is on; off, none hides."""
    tp_overlap: float = 1.0
    """Largest share of tensor-parallel collectives hidden behind the GEMMs they feed when the
    plan's ``tp_comm_overlap`` is on, before the ring's first step that never hides ((tp - 1) /
    tp at most); off (Megatron-LM 2021), they sit on the critical path."""
    overlap_slowdown: float = 0.18
    """Compute slowed by overlapped communication: a collective running beside compute holds
    this share of the SMs, so every hidden second adds this many seconds (NCCL's all-gather
    holds 24 of an H100's 132 SMs, 0.18)."""
    grad_bucket_bytes: float = 25 * 2**20
    """Bytes of one gradient bucket (torch DDP's ``bucket_cap_mb`` = 25): with
    ``overlap_grad_reduce`` the last bucket is reduced after the last gradient is ready."""
    tp_overlap_buffers: float = 2.0
    """Buffers of one micro-batch's b x s x h hidden state, in the compute dtype, that
    TransformerEngine's userbuffers keep on each rank when ``tp_comm_overlap`` is on."""
    optimizer_bytes_per_param: float = 16.0
    """HBM bytes read and written per parameter by the Adam update (time = bytes / HBM bw)."""
    memory_reserve_fraction: float = 0.05
    """Share of device memory kept free for allocator fragmentation."""
    context_bytes: float = 1.0 * 2**30
    """Bytes taken by the CUDA context, communicator buffers and workspace per device."""

    def __post_init__(self) -> None:
        rules = (  # (fields, whether a value is in range, the range)
            (("matmul_efficiency", "link_efficiency", "fp8_cast_bandwidth_efficiency",
              "fp8_autocast_cast_bandwidth_efficiency"), lambda v: 0 < v <= 1, "in (0, 1]"),
            (("zero3_overlap", "overlap_slowdown", "memory_reserve_fraction"),
             lambda v: 0 <= v < 1, "in [0, 1)"),
            (("dp_overlap", "tp_overlap"), lambda v: 0 <= v <= 1, "in [0, 1]"),
            (("grad_bucket_bytes", "tp_overlap_buffers", "elementwise_passes",
              "eager_elementwise_passes", "efficiency_half_width", "efficiency_half_tokens"),
             lambda v: not v < 0, ">= 0"),
        )
        for names, ok, bounds in rules:
            for name in names:
                if not ok(getattr(self, name)):
                    raise ValueError(f"{name} must be {bounds}, got {getattr(self, name)}")
        for name, value in self.gpu_matmul_efficiency:
            if not 0 < value <= 1:
                raise ValueError(f"gpu_matmul_efficiency of {name} must be in (0, 1], got {value}")
        if self.gemm_tile < 0:
            raise ValueError(f"gemm_tile must be >= 0 (0: no wave quantisation), got {self.gemm_tile}")
