"""ModelSpec and LayerSpec: the model as the cost model and the runtime see it.

A ModelSpec is an ordered list of layers (embedding, transformer blocks, head) for one sequence
length. Every figure is per token so that micro-batch size and sequence length multiply in later.
Activation bytes are split in two parts so that tensor and sequence parallelism can divide them
exactly as Korthikanti et al. 2022 (Table 2) do:

- ``shared``: tensors every tensor-parallel rank holds whole (layer-norm inputs, the inputs of
  column-parallel linears, dropout masks); sequence parallelism divides them by t.
- ``split``: tensors tensor parallelism already divides by t (attention heads, FFN hidden).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum


class Arch(StrEnum):
    """Architecture family the runtime builds a ModelSpec as."""

    GPT = "gpt"  # GPT-2 style: LayerNorm, GeLU MLP, learned positions
    LLAMA = "llama"  # RMSNorm, SwiGLU, RoPE, grouped-query attention
    CUSTOM = "custom"  # a traced module: the runtime cannot rebuild it


class LayerKind(StrEnum):
    EMBEDDING = "embedding"
    BLOCK = "block"
    HEAD = "head"


class Recompute(StrEnum):
    """Activation recompute of one layer (Korthikanti et al. 2022)."""

    NONE = "none"
    SELECTIVE = "selective"  # recompute the attention core only
    FULL = "full"  # keep the layer input, recompute the whole layer in backward


@dataclass(frozen=True, slots=True)
class ActivationBytes:
    """Bytes per token a layer keeps for backward, for one recompute mode."""

    shared: float
    """Bytes per token held whole by every tensor-parallel rank (divided by t only with sequence parallel)."""
    split: float
    """Bytes per token that tensor parallelism divides by t."""

    def per_rank(self, tp: int, sequence_parallel: bool) -> float:
        """Bytes per token on one tensor-parallel rank."""
        # Korthikanti Table 2: s*b*h*(10 + 24/t) without SP, s*b*h*34/t with SP.
        shared = self.shared / tp if sequence_parallel else self.shared
        return shared + self.split / tp


@dataclass(frozen=True, slots=True)
class RuntimeActivation:
    """How meshmorph's own decoder block (run/model/decoder.py) departs from the fused counts of
    ``LayerSpec.activation`` (Korthikanti's, which Megatron-LM's fused kernels and a
    ``torch.compile``d block keep), as measured tensor by tensor on an H200
    (bench/activation_probe.py): what ``Plan.compile`` and the residual stream's dtype change."""

    norm_inputs: int
    """Norms reading the residual stream. Under autocast the stream is fp32 (the embedding's
    output, plus the blocks' outputs), so an eager block keeps each norm's input at 4 bytes, 2
    more per element than the count; a compiled block keeps only its own input in fp32 (the
    second norm's input is recomputed from it)."""
    norm_readers: int
    """Projections reading a norm's output beyond one per norm (gpt: k and v beside q; llama: k,
    v and w3). Eager autocast casts the fp32 norm output once per projection and each linear
    keeps its own 16-bit copy (2 bytes per element each); compiled, one copy serves all."""
    recomputed_pointwise: float
    """16-bit bytes per token, divided by t like ``ActivationBytes.split``, of pointwise results
    that a compiled backward recomputes instead of keeping: SwiGLU's silu(gate) (2f) for llama,
    none for gpt (GeLU's output is fc2's input: kept)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerSpec:
    """One layer of a model, with every figure the cost model needs."""

    name: str
    """Layer name, unique in the model (``embed``, ``block.0`` ... ``head``)."""
    kind: LayerKind
    """Embedding, transformer block or output head."""
    params: int
    """Number of parameters of this layer."""
    tp_split_params: int
    """Parameters that tensor parallelism splits across t ranks (the rest are replicated)."""
    fwd_flops_per_token: float
    """Forward FLOPs per token (matmuls 2*in*out, attention at the spec's sequence length)."""
    recompute_flops_per_token: dict[Recompute, float] = field(default_factory=dict)
    """Extra forward FLOPs per token re-done in backward for each recompute mode (none -> 0)."""
    activation: dict[Recompute, ActivationBytes] = field(default_factory=dict)
    """Activation bytes per token kept for backward, for each recompute mode the layer supports."""
    tp_allreduces_fwd: int = 0
    """Tensor-parallel all-reduces of the hidden state in forward (as many again in backward)."""
    transient_bytes_per_token: float = 0.0
    """Bytes per token the layer holds only while it runs (freed before the next layer's work),
    divided by t like ``ActivationBytes.split``: the head's loss buffers (fp32 logits and their
    gradients). Counted once per rank, beside the working set of a recomputed layer."""
    tied_params: int = 0
    """Parameters shared with an earlier layer (a tied output head): counted once in the model,
    but held by every pipeline stage that has either layer."""
    runtime: RuntimeActivation | None = None
    """What meshmorph's decoder block keeps beyond (or short of) ``activation`` when run eagerly or
    compiled; None: ``activation`` as it stands (embedding, head, traced modules)."""
    flash_attention: bool = False
    """The layer's FLOPs beyond its GEMMs (``cost.gemm.layer_gemms``) are a causal attention core
    run as one flash kernel, which skips the masked half of the scores
    (``CostCoefficients.flash_attention_efficiency``); False: batched GEMMs over the whole s x s
    scores (Megatron-LM before flash attention), or work that is no attention at all."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """A model for one sequence length: ordered layers plus the shape the runtime builds from."""

    name: str
    """Catalog name, config path or factory the spec came from."""
    arch: Arch
    """Architecture family (``Arch``: gpt, llama, or custom for a traced module)."""
    layers: tuple[LayerSpec, ...]
    """Embedding, blocks and head, in execution order."""
    hidden_size: int
    """Model width h."""
    num_heads: int
    """Attention heads a."""
    num_kv_heads: int
    """Key/value heads (== num_heads without grouped-query attention)."""
    ffn_hidden_size: int
    """FFN inner width (4h for GPT, the SwiGLU width for Llama)."""
    vocab_size: int
    """Vocabulary V."""
    seq_len: int
    """Sequence length s the per-token figures were computed for."""
    padded_vocab_size: int = 0
    """Rows of the embedding and columns of the head the runtime allocates and the cost model
    prices (V rounded up for fast GPU matmuls; the extra logits are never read); 0 means V."""
    tied_embeddings: bool = False
    """Output head shares the embedding matrix."""
    dtype_bytes: int = 2
    """Bytes per element of parameters and activations in training (2 for bf16/fp16)."""
    tp_splittable: bool = True
    """Whether tensor parallelism can split this model (False for traced custom modules)."""

    def __post_init__(self) -> None:
        if self.arch not in tuple(Arch):
            raise ValueError(f"model {self.name!r}: arch must be one of {', '.join(Arch)}, "
                             f"got {self.arch!r}")
        object.__setattr__(self, "arch", Arch(self.arch))
        if not self.layers:
            raise ValueError(f"model {self.name!r} has no layers")
        names = [layer.name for layer in self.layers]
        if len(set(names)) != len(names):
            raise ValueError(f"model {self.name!r} has duplicate layer names")
        if not self.padded_vocab_size:
            object.__setattr__(self, "padded_vocab_size", self.vocab_size)
        if self.padded_vocab_size < self.vocab_size:
            raise ValueError(f"model {self.name!r}: padded_vocab_size {self.padded_vocab_size} is "
                             f"below vocab_size {self.vocab_size}; pad up, never down")

    @property
    def num_layers(self) -> int:
        """Number of LayerSpecs (embedding + blocks + head)."""
        return len(self.layers)

    @property
    def num_blocks(self) -> int:
        return sum(1 for layer in self.layers if layer.kind == LayerKind.BLOCK)

    @property
    def num_params(self) -> int:
        """Unique parameters (a tied head is counted once)."""
        return sum(layer.params - layer.tied_params for layer in self.layers)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def fwd_flops_per_token(self) -> float:
        return sum(layer.fwd_flops_per_token for layer in self.layers)

    def model_flops_per_token(self) -> float:
        """Training FLOPs per token without recompute: forward + 2x for backward."""
        return 3.0 * self.fwd_flops_per_token()

    def with_seq_len(self, seq_len: int) -> ModelSpec:
        """The same architecture at another sequence length (catalog and HF models only)."""
        if seq_len == self.seq_len:
            return self
        if self.arch == Arch.CUSTOM:
            raise ValueError(
                f"model {self.name!r} was traced at seq_len {self.seq_len}; trace it again at {seq_len}"
            )
        from meshmorph.spec.transformer import TransformerShape, build_transformer

        return replace(
            build_transformer(TransformerShape.from_spec(self, seq_len=seq_len)), name=self.name
        )
