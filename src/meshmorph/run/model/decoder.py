"""Reference decoders built from a ModelSpec: GPT-2 style and Llama style, at any size.

The module tree mirrors ``ModelSpec.layers``: ``embed`` is layer 0, ``blocks[str(i)]`` is layer
``i + 1`` and ``head`` is the last layer, so a StagePlan's layer range names the modules a pipeline
chunk keeps. Every parameter draws its initial value in row blocks, each from its own generator
seeded by ``(seed, layer index, parameter name, block index)`` (``init_value``): a chunk built
alone, or one rank's shard of it materialised from the meta device, holds bitwise the same
weights as the same positions of the whole model, on every rank and under every plan. The embedding and head hold
``padded_vocab_size`` rows; the head hands back only the first ``vocab_size`` logits. The model
code holds no parallelism.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from meshmorph.run.model.loss import mask_padded_vocab
from meshmorph.spec.model import ModelSpec

INIT_STD = 0.02
"""Standard deviation of the normal initialisation of every weight matrix and embedding."""


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale (Zhang & Sennrich 2019)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


SDPA_GQA = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)
"""Whether ``scaled_dot_product_attention`` takes ``enable_gqa`` (torch 2.5 on)."""


class AttentionCore(nn.Module):
    """Causal softmax attention of already projected heads; holds no parameters, so selective
    recompute can checkpoint exactly this part."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q [b, heads, s, d], k/v [b, kv_heads, s, d]; grouped-query heads share k/v
        if k.shape[1] == q.shape[1]:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if SDPA_GQA:  # the kernel reads each k/v head for its group: no copies saved for backward
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        repeat = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(repeat, dim=1),
                                              v.repeat_interleave(repeat, dim=1), is_causal=True)


def rotary(x: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021) of x [b, s, heads, d], pairs (i, i + d/2): the
    projection's output in its own layout, transposed to [b, heads, s, d] only afterwards, as
    a view (the result is the same element for element)."""
    s, d = x.shape[1], x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    angles = torch.outer(torch.arange(s, dtype=torch.float32, device=x.device), inv_freq)  # [s, d/2]
    cos, sin = angles.cos().to(x.dtype)[:, None], angles.sin().to(x.dtype)[:, None]  # [s, 1, d/2]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    """Multi-head (GPT) or grouped-query (Llama, RoPE) causal self-attention.

    Head counts are read from the projection widths at run time, so a tensor-parallel rank that
    holds heads/t of the columns runs the same code."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, kv = spec.hidden_size, spec.num_kv_heads * spec.head_dim
        bias = spec.arch == "gpt"
        self.head_dim = spec.head_dim
        self.rope = spec.arch == "llama"
        self.wq = nn.Linear(h, h, bias=bias)
        self.wk = nn.Linear(h, kv, bias=bias)
        self.wv = nn.Linear(h, kv, bias=bias)
        self.core = AttentionCore()
        self.wo = nn.Linear(h, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[0], x.shape[1]
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if self.rope:
            q, k = rotary(q), rotary(k)
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # [b, heads, s, d]
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class GeluMLP(nn.Module):
    """GPT feed-forward: fc2(gelu(fc1(x)))."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.fc1 = nn.Linear(spec.hidden_size, spec.ffn_hidden_size)
        self.fc2 = nn.Linear(spec.ffn_hidden_size, spec.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class SwiGLU(nn.Module):
    """Llama feed-forward: w2(silu(w1(x)) * w3(x))."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, f = spec.hidden_size, spec.ffn_hidden_size
        self.w1 = nn.Linear(h, f, bias=False)
        self.w3 = nn.Linear(h, f, bias=False)
        self.w2 = nn.Linear(f, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def _norm(spec: ModelSpec) -> nn.Module:
    return nn.LayerNorm(spec.hidden_size) if spec.arch == "gpt" else RMSNorm(spec.hidden_size)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.attn_norm = _norm(spec)
        self.attn = Attention(spec)
        self.mlp_norm = _norm(spec)
        self.mlp = GeluMLP(spec) if spec.arch == "gpt" else SwiGLU(spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Embedding(nn.Module):
    """Token embedding, plus learned positions for GPT."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.tok = nn.Embedding(spec.padded_vocab_size, spec.hidden_size)  # rows >= V never indexed
        self.pos = nn.Embedding(spec.seq_len, spec.hidden_size) if spec.arch == "gpt" else None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens)
        if self.pos is not None:
            x = x + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        return x


class Head(nn.Module):
    """Final norm and the projection to vocabulary logits: the matmul runs over the padded
    vocabulary, and only the first V logits leave the head, so the loss and every gradient of
    the real rows are those of the unpadded model (the padded columns get a zero gradient)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.norm = _norm(spec)
        self.vocab_size = spec.vocab_size
        self.padded = spec.padded_vocab_size != spec.vocab_size
        self.out = nn.Linear(spec.hidden_size, spec.padded_vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.out(self.norm(x))
        if isinstance(logits, DTensor):  # sharded on the vocabulary, for loss_parallel
            return mask_padded_vocab(logits, self.vocab_size) if self.padded else logits
        return logits[..., : self.vocab_size] if self.padded else logits


class Transformer(nn.Module):
    """A decoder, or a contiguous chunk of one (``embed``/``head`` None where the chunk lacks them).

    forward: tokens [b, s] (a chunk with the embedding) or hidden [b, s, h] -> hidden or logits."""

    def __init__(self, spec: ModelSpec, start: int, stop: int) -> None:
        super().__init__()
        last = spec.num_layers - 1
        self.embed = Embedding(spec) if start == 0 else None
        self.blocks = nn.ModuleDict(
            {str(i - 1): Block(spec) for i in range(max(start, 1), min(stop, last))}
        )
        self.head = Head(spec) if stop > last else None
        if spec.tied_embeddings and self.embed is not None and self.head is not None:
            self.head.out.weight = self.embed.tok.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks.values():
            x = block(x)
        if self.head is not None:
            x = self.head(x)
        return x


def layer_of(spec: ModelSpec, name: str) -> tuple[int, str]:
    """``(layer index, name inside the layer)`` of a chunk parameter's name: ``embed.tok.weight``
    -> (0, ``tok.weight``), ``blocks.3.attn.wq.weight`` -> (4, ``attn.wq.weight``), ``head.*`` ->
    (num_layers - 1, ``*``)."""
    top, _, rest = name.partition(".")
    if top == "embed":
        return 0, rest
    if top == "head":
        return spec.num_layers - 1, rest
    if top == "blocks":
        key, _, rest = rest.partition(".")
        return int(key) + 1, rest
    raise ValueError(f"parameter {name!r} is not under embed, blocks.<i> or head; initialise "
                     "only chunks built by build_chunk (before any DDP wrapper renames them)")


INIT_BLOCK_BYTES = 2**20
"""Most fp32 bytes of one initialisation block: a parameter's value is drawn in blocks of whole
rows along dim 0, each block from its own generator, so a rank draws only the blocks its shard
overlaps and never holds more than one block beyond its shard."""


def init_rows_per_block(shape: tuple[int, ...]) -> int:
    """Rows (along dim 0) of one initialisation block of a parameter of global ``shape``: as many
    as fit in ``INIT_BLOCK_BYTES`` of fp32, at least one. Fixed by the shape, never by a layout."""
    row_numel = math.prod(shape[1:])  # 1 for a vector
    return max(1, INIT_BLOCK_BYTES // (4 * row_numel))


def _block_seed(seed: int, layer: int, name: str, block: int) -> int:
    """A generator seed of its own for every (seed, layer, parameter, row block): any rank can
    draw any block of any parameter without drawing the others."""
    digest = hashlib.blake2b(f"{seed}/{layer}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _bounded_box(box: tuple[slice, ...] | None, shape: tuple[int, ...]) -> tuple[slice, ...]:
    """``box`` with explicit, in-range bounds (None: the whole of ``shape``)."""
    if box is None:
        return tuple(slice(0, n) for n in shape)
    if len(box) != len(shape) or any(s.step not in (None, 1) for s in box):
        raise ValueError(f"box {box} is not one unit-step slice per dim of the shape {list(shape)}")
    bounded = [s.indices(n)[:2] for s, n in zip(box, shape, strict=True)]
    return tuple(slice(start, max(start, stop)) for start, stop in bounded)


def fill_init_value_(out: torch.Tensor, spec: ModelSpec, layer: int, name: str,
                     shape: tuple[int, ...], *, seed: int,
                     box: tuple[slice, ...] | None = None) -> torch.Tensor:
    """Write into ``out`` the box ``box`` (one slice per dim, unit steps; None: the whole tensor)
    of the fp32 value ``init_value`` gives parameter ``name`` of layer ``layer``.

    Only the row blocks that overlap ``box`` are drawn, one at a time, and each is cut to the box
    (rows and columns) before the next one is drawn: beyond ``out`` at most one block is alive."""
    box = _bounded_box(box, shape)
    if tuple(out.shape) != tuple(s.stop - s.start for s in box):
        raise ValueError(f"out of shape {list(out.shape)} does not hold the box {box} of the "
                         f"global shape {list(shape)}")
    owner = name.rpartition(".")[0].rpartition(".")[2]  # the module holding it: "wq", "attn_norm"
    if name.endswith("bias"):
        return out.zero_()
    if owner.endswith("norm"):  # attn_norm, mlp_norm, the head's norm: LayerNorm or RMSNorm
        return out.fill_(1.0)
    vocab_table = (layer == 0 and name == "tok.weight") or (
        layer == spec.num_layers - 1 and name == "out.weight")
    if vocab_table and spec.tied_embeddings:
        layer, name = 0, "tok.weight"  # one matrix, wherever the head is
    std = INIT_STD / math.sqrt(2 * spec.num_blocks) if owner in ("wo", "fc2", "w2") else INIT_STD
    # rows >= real are the padded vocabulary rows: zero, drawn by no generator
    real = spec.vocab_size if vocab_table else shape[0]
    rows, per_block = box[0], init_rows_per_block(shape)
    for block in range(rows.start // per_block, -(-rows.stop // per_block)):
        first, stop = block * per_block, min((block + 1) * per_block, shape[0])  # block's rows
        lo, hi = max(first, rows.start), min(stop, rows.stop)  # its rows inside the box
        if lo >= hi:
            continue
        target = out[lo - rows.start: hi - rows.start]
        drawn = max(0, min(stop, real) - first)  # the block's rows that hold real values
        if drawn == 0:
            target.zero_()
            continue
        generator = torch.Generator().manual_seed(_block_seed(seed, layer, name, block))
        value = torch.randn((drawn, *shape[1:]), generator=generator)
        value.mul_(std)
        real_hi = min(hi, first + drawn)  # rows of the box this block drew
        if real_hi > lo:
            target[: real_hi - lo].copy_(value[(slice(lo - first, real_hi - first), *box[1:])])
        target[max(0, real_hi - lo):].zero_()
        del value  # one block at a time
    return out


def init_value(spec: ModelSpec, layer: int, name: str, shape: tuple[int, ...], *,
               seed: int, box: tuple[slice, ...] | None = None) -> torch.Tensor:
    """The fp32 value the whole model built from ``seed`` holds in parameter ``name`` of layer
    ``layer`` (global shape ``shape``), on the host; only its box ``box`` when given.

    Normal(0, 0.02) weights and embeddings, zero biases, unit norm scales; the residual output
    projections (wo, fc2/w2) scaled by 1/sqrt(2 L) as in GPT-2. The padded vocabulary rows
    (embedding rows and head columns V..V_padded) are zero: never indexed, never read, so their
    gradient and their AdamW update stay zero. A tied head holds the embedding's value.

    Block-stable: the value is drawn in row blocks of ``init_rows_per_block(shape)`` rows, each
    from its own generator seeded by (seed, layer, name, block index), so any box of it drawn
    alone equals the same box of the whole, whatever layout asks for it."""
    box = _bounded_box(box, shape)
    out = torch.empty(tuple(s.stop - s.start for s in box))
    return fill_init_value_(out, spec, layer, name, shape, seed=seed, box=box)


def build_chunk(spec: ModelSpec, start: int, stop: int, *, seed: int,
                dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> Transformer:
    """Layers [start, stop) of the model, with the weights the whole model would hold.

    ``device="meta"`` allocates nothing and initialises nothing: parallelize the chunk there, then
    ``materialize_`` gives each rank only its own shards, with these same values."""
    if spec.arch not in ("gpt", "llama"):
        raise ValueError(
            f"model {spec.name!r} has arch {spec.arch!r}: the runtime rebuilds only 'gpt' and "
            "'llama' decoders (a traced custom module cannot be rebuilt); use a catalog model or "
            "an HF config"
        )
    if not 0 <= start < stop <= spec.num_layers:
        raise ValueError(f"layer range [{start}, {stop}) is outside [0, {spec.num_layers})")
    with torch.device("meta"):
        model = Transformer(spec, start, stop)
    if torch.device(device).type != "meta":
        from meshmorph.run.model.materialize import materialize_

        materialize_(model, spec, seed=seed, device=device)
    return model.to(dtype)


def build_model(spec: ModelSpec, *, seed: int, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> Transformer:
    """The whole decoder of ``spec`` (arch ``gpt`` or ``llama``), initialised from ``seed``: the
    one-device reference every layout's shards are cut from."""
    return build_chunk(spec, 0, spec.num_layers, seed=seed, dtype=dtype, device=device)
