"""Per-layer figures of GPT-2 style and Llama style decoders, from their shape.

Sources: parameters and FLOPs as in Narayanan et al. 2021 (matmul = 2*m*n*k FLOPs, attention
counted over the full s x s score matrix, as their Eq. 3 does); activation bytes from Korthikanti
et al. 2022 Table 2, derived tensor by tensor for SwiGLU and grouped-query attention.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshmorph.spec.model import (
    ActivationBytes,
    LayerKind,
    LayerSpec,
    ModelSpec,
    Recompute,
    RuntimeActivation,
)

VOCAB_MULTIPLE = 128
"""The runtime pads the vocabulary to a multiple of this (tensor-core friendly head and embedding
matmuls on GPUs; every tensor-parallel degree up to 128 that is a power of two divides it)."""


SHAPE_LIMITS = {"num_layers": 4096, "hidden_size": 1 << 20, "num_heads": 1 << 16,
                "vocab_size": 1 << 24, "seq_len": 1 << 24}
"""The largest shape meshmorph describes (published models: 126 blocks, h 16384, 128 heads, a
256k vocabulary, 1M-token contexts). A larger value is a typo, and describing it would take
minutes (one LayerSpec per block) before any error."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TransformerShape:
    """The shape of a decoder-only transformer."""

    name: str
    """Name carried into the ModelSpec."""
    arch: str
    """``gpt`` or ``llama``."""
    num_layers: int
    """Transformer blocks L."""
    hidden_size: int
    """Width h."""
    num_heads: int
    """Attention heads a."""
    vocab_size: int
    """Vocabulary V."""
    seq_len: int
    """Sequence length s."""
    num_kv_heads: int | None = None
    """Key/value heads (GQA); None means num_heads."""
    ffn_hidden_size: int | None = None
    """FFN width; None means 4h (gpt) or Llama's 2/3*4h rounded up to a multiple of 256."""
    tied_embeddings: bool | None = None
    """Head shares the embedding; None means True for gpt, False for llama."""
    flash_attention: bool | None = None
    """Attention kernel keeps no s x s scores; None means True: meshmorph's runtime runs every
    model through ``F.scaled_dot_product_attention`` (flash or memory-efficient kernels on GPUs,
    the flash kernel on CPU). Set False to price a run that kept the scores (Megatron 2021)."""
    dropout: bool = False
    """Dropout after the embedding, the attention softmax and both residual branches
    (Megatron's hidden and attention dropout: 1-byte masks kept for backward). False: meshmorph's
    runtime (run/model/decoder.py) has no dropout."""
    runtime: bool = True
    """meshmorph's decoder (run/model/decoder.py) and loss (run/model/loss.py) run the model, so
    its eager and compiled departures from the fused counts apply (``LayerSpec.runtime``) and
    whole logits go through the row-chunked loss; False for a run of another framework described
    by its own counts (Megatron-LM's fused kernels over a 16-bit stream, torchtitan's blocks
    under FSDP2; both take the cross-entropy of a fp32 copy of the logits)."""
    selective: str = "attention"
    """What ``Recompute.SELECTIVE`` keeps: ``attention`` (Korthikanti et al. 2022: recompute the
    attention core, keep the rest) or ``op`` (torchtitan's per-op selective checkpointing, Llama
    only: keep the outputs of the first, third, fifth and seventh matmul of the block (q, v, the
    MLP's gate and down projections), the attention kernel's output and the layer input; recompute
    the other matmuls (k, the output projection, the MLP's up projection) and every
    memory-bound op)."""
    dtype_bytes: int = 2
    """Bytes per parameter/activation element in training."""
    padded_vocab_size: int | None = None
    """Embedding rows and head columns the runtime allocates; None means vocab_size rounded up
    to a multiple of 128 (VOCAB_MULTIPLE). The padded logits are never read by the loss."""

    def __post_init__(self) -> None:
        if self.arch not in ("gpt", "llama"):
            raise ValueError(f"arch must be 'gpt' or 'llama', got {self.arch!r}")
        for field_name, limit in SHAPE_LIMITS.items():
            value = getattr(self, field_name)
            if value <= 0:
                raise ValueError(f"{field_name} must be positive, got {value}")
            if value > limit:
                raise ValueError(f"{field_name} {value:,} is above meshmorph's limit of {limit:,} "
                                 f"(the largest published models are far below it); check the "
                                 "config for a typo")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}"
            )
        if self.kv_heads <= 0 or self.num_heads % self.kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.kv_heads}"
            )
        if self.selective not in ("attention", "op") or (self.selective == "op"
                                                         and self.arch != "llama"):
            raise ValueError(f"selective must be 'attention' or 'op' (Llama only), got "
                             f"{self.selective!r} for arch {self.arch!r}")
        if self.padded_vocab_size is not None and self.padded_vocab_size < self.vocab_size:
            raise ValueError(f"padded_vocab_size {self.padded_vocab_size} is below vocab_size "
                             f"{self.vocab_size}; leave it None to pad to a multiple of "
                             f"{VOCAB_MULTIPLE}")

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def ffn(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        if self.arch == "gpt":
            return 4 * self.hidden_size
        return 256 * -(-int(2 * 4 * self.hidden_size / 3) // 256)

    @property
    def padded_vocab(self) -> int:
        """``padded_vocab_size``, or V rounded up to a multiple of ``VOCAB_MULTIPLE``."""
        return self.padded_vocab_size or VOCAB_MULTIPLE * -(-self.vocab_size // VOCAB_MULTIPLE)

    @property
    def tied(self) -> bool:
        return self.arch == "gpt" if self.tied_embeddings is None else self.tied_embeddings

    @property
    def flash(self) -> bool:
        return True if self.flash_attention is None else self.flash_attention

    @classmethod
    def from_spec(cls, spec: ModelSpec, *, seq_len: int) -> TransformerShape:
        """The shape ``spec`` was built from, at ``seq_len``; what the blocks' figures say is read
        back from the first block."""
        block = next(layer for layer in spec.layers if layer.kind == LayerKind.BLOCK)
        h = spec.hidden_size
        return cls(
            name=spec.name, arch=spec.arch, num_layers=spec.num_blocks, hidden_size=h,
            num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
            ffn_hidden_size=spec.ffn_hidden_size, vocab_size=spec.vocab_size, seq_len=seq_len,
            tied_embeddings=spec.tied_embeddings, flash_attention=block.flash_attention,
            # the two residual dropout masks are the only shared bytes beyond the 8h of norm
            # and projection inputs (both archs)
            dropout=block.activation[Recompute.NONE].shared > 8.0 * h * spec.dtype_bytes / 2,
            # per-op selective recompute re-runs matmuls, the attention form only the core
            selective="op" if block.recompute_flops_per_token[Recompute.SELECTIVE]
            != 4.0 * spec.seq_len * h else "attention",
            runtime=block.runtime is not None, dtype_bytes=spec.dtype_bytes,
            padded_vocab_size=spec.padded_vocab_size)


def _block(shape: TransformerShape, index: int) -> LayerSpec:
    h, a, s, f = shape.hidden_size, shape.num_heads, shape.seq_len, shape.ffn
    h_kv = shape.kv_heads * (h // a)
    scale = shape.dtype_bytes / 2  # Korthikanti counts 16-bit tensors (2 bytes) and 1-byte masks
    attention_flops = 4.0 * s * h  # QK^T and AV: 2*s*h each per token
    # Korthikanti: shared = 2 norm inputs 4h + qkv input 2h + MLP input 2h (+ 1-byte dropout
    # masks after attention and after the MLP, 2h)
    shared = 8.0 * h + (2.0 * h if shape.dropout else 0.0)
    # softmax output 2as (+ dropout mask as + dropout output 2as); a flash kernel keeps only its
    # output (the out-proj input) and a fp32 log-sum-exp per head and token (4a bytes, under
    # 0.3% of the block: left out)
    scores = 0.0 if shape.flash else (5.0 if shape.dropout else 2.0) * a * s
    if shape.arch == "gpt":
        # qkv (3h^2 + 3h), out proj (h^2 + h), fc1 (hf + f), fc2 (fh + h), two LayerNorms (4h)
        params = 4 * h * h + 2 * h * f + 9 * h + f
        replicated = 2 * h + 4 * h  # out/fc2 biases and LayerNorms are not split
        matmul_flops = 2.0 * (4 * h * h + 2 * h * f)
        # split = Q,K 4h + V 2h + out-proj input 2h + GeLU in 2f + GeLU out 2f
        split = 8.0 * h + 4.0 * f
    else:
        # q, o: h^2 each; k, v: h*h_kv each; gate, up, down: h*f each; two RMSNorms: h each
        params = 2 * h * h + 2 * h * h_kv + 3 * h * f + 2 * h
        replicated = 2 * h
        matmul_flops = 2.0 * (2 * h * h + 2 * h * h_kv + 3 * h * f)
        # split = Q 2h + K,V 4*h_kv + attention output 2h + gate 2f + up 2f + silu(gate) 2f + product 2f
        split = 4.0 * h + 4.0 * h_kv + 8.0 * f
    fwd = matmul_flops + attention_flops
    selective_flops, selective_act = attention_flops, ActivationBytes(shared * scale, split * scale)
    if shape.selective == "op":
        # torchtitan's policy keeps every other matmul's output (the 1st, 3rd, 5th, 7th of the
        # block: q 2h, v 2h_kv, gate 2f, down 2h, the latter a partial sum held whole by every
        # tensor-parallel rank), the attention output 2h and the layer input 2h (the checkpoint's
        # input, sequence-parallel); it re-runs k, the output projection and the up projection
        selective_flops = 2.0 * (h * h_kv + h * h + h * f)
        selective_act = ActivationBytes((2.0 * h + 2.0 * h) * scale,
                                        (2.0 * h + 2.0 * h_kv + 2.0 * h + 2.0 * f) * scale)
    return LayerSpec(
        name=f"block.{index}", kind=LayerKind.BLOCK, params=params,
        tp_split_params=params - replicated, fwd_flops_per_token=fwd,
        recompute_flops_per_token={Recompute.NONE: 0.0, Recompute.SELECTIVE: selective_flops,
                                   Recompute.FULL: fwd},
        activation={
            Recompute.NONE: ActivationBytes(shared * scale, (split + scores) * scale),
            Recompute.SELECTIVE: selective_act,
            # full recompute keeps only the layer input: 2*s*b*h (16-bit)
            Recompute.FULL: ActivationBytes(2.0 * h * scale, 0.0),
        },
        tp_allreduces_fwd=2,
        # gpt: k and v read the first norm's output beside q; llama: k, v beside q and w3 beside w1
        runtime=RuntimeActivation(
            norm_inputs=2, norm_readers=2 if shape.arch == "gpt" else 3,
            recomputed_pointwise=0.0 if shape.arch == "gpt" else 2.0 * f * scale)
        if shape.runtime else None,
        flash_attention=shape.flash,
    )


def build_transformer(shape: TransformerShape) -> ModelSpec:
    """A ModelSpec for a GPT-2 style or Llama style decoder."""
    # the runtime allocates (and computes) the padded vocabulary: price what runs
    h, v, s = shape.hidden_size, shape.padded_vocab, shape.seq_len
    scale = shape.dtype_bytes / 2
    positions = s * h if shape.arch == "gpt" else 0  # learned position embeddings (GPT only)
    embed = LayerSpec(
        name="embed", kind=LayerKind.EMBEDDING, params=v * h + positions,
        tp_split_params=v * h,  # vocab-parallel embedding
        fwd_flops_per_token=0.0, recompute_flops_per_token={Recompute.NONE: 0.0},
        # the embedding keeps only the token ids (int64) for its backward, and the dropout mask
        # where there is dropout; its output is the first block's input, counted there
        activation={Recompute.NONE: ActivationBytes(
            8.0 + (h * scale if shape.dropout else 0.0), 0.0)},
        tp_allreduces_fwd=1,
    )
    norm_params = 2 * h if shape.arch == "gpt" else h
    head = LayerSpec(
        name="head", kind=LayerKind.HEAD, params=v * h + norm_params, tp_split_params=v * h,
        fwd_flops_per_token=2.0 * h * v, recompute_flops_per_token={Recompute.NONE: 0.0},
        # final-norm input 2h and head input 2h, plus the loss's fp32 log-softmax of the logits
        # (4V, vocab-parallel), kept for backward (run/model/loss.py: the logits leave the head in
        # the compute dtype and the loss writes their fp32 log-probabilities)
        activation={Recompute.NONE: ActivationBytes(4.0 * h * scale, 4.0 * v)},
        # while the vocabulary-parallel loss runs (torch's loss_parallel over a fp32 copy of the
        # shards): in forward the compute-dtype logits and their fp32 copy beside the
        # log-softmax, in backward two fp32 gradient buffers of the logits: 8V per token at most,
        # split by tp; the whole-logits loss holds less (cost/rank_terms.py head_loss_bytes)
        transient_bytes_per_token=8.0 * v,
        tp_allreduces_fwd=1,
        tied_params=v * h if shape.tied else 0,
    )
    blocks = tuple(_block(shape, i) for i in range(shape.num_layers))
    return ModelSpec(
        name=shape.name, arch=shape.arch, layers=(embed, *blocks, head), hidden_size=h,
        num_heads=shape.num_heads, num_kv_heads=shape.kv_heads, ffn_hidden_size=shape.ffn,
        vocab_size=shape.vocab_size, padded_vocab_size=v, seq_len=s,
        tied_embeddings=shape.tied, dtype_bytes=shape.dtype_bytes)
