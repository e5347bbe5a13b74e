"""Reference decoders built from a ModelSpec: GPT-2 style and Llama style, at any size.

The module tree mirrors ``ModelSpec.layers``: ``embed`` is layer 0, ``blocks[str(i)]`` is layer
``i + 1`` and ``head`` is the last layer, so a StagePlan's layer range names the modules a pipeline
chunk keeps. Every layer draws its initial weights from its own generator seeded by
``(seed, layer index)``: a chunk built alone holds bitwise the same weights as the same layers of
the whole model, on every rank and under every plan. The model code holds no parallelism.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

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


class AttentionCore(nn.Module):
    """Causal softmax attention of already projected heads; holds no parameters, so selective
    recompute can checkpoint exactly this part."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q [b, heads, s, d], k/v [b, kv_heads, s, d]; grouped-query heads share k/v
        if k.shape[1] != q.shape[1]:
            repeat = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(repeat, dim=1)
            v = v.repeat_interleave(repeat, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def rotary(x: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021) of x [b, heads, s, d], pairs (i, i + d/2)."""
    s, d = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    angles = torch.outer(torch.arange(s, dtype=torch.float32, device=x.device), inv_freq)  # [s, d/2]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
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
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        if self.rope:
            q, k = rotary(q), rotary(k)
        out = self.core(q, k, v)  # [b, heads, s, d]
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
        self.tok = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.pos = nn.Embedding(spec.seq_len, spec.hidden_size) if spec.arch == "gpt" else None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens)
        if self.pos is not None:
            x = x + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        return x


class Head(nn.Module):
    """Final norm and the projection to vocabulary logits."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.norm = _norm(spec)
        self.out = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


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


def _init_layer(module: nn.Module, generator: torch.Generator, num_blocks: int,
                done: set[int]) -> None:
    """Normal(0, 0.02) weights and embeddings, zero biases, unit norms; the residual output
    projections (wo, fc2/w2) scaled by 1/sqrt(2 L) as in GPT-2. Skips parameters in ``done``
    (a tied head weight is the embedding's)."""
    residual_std = INIT_STD / math.sqrt(2 * num_blocks)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if id(param) in done:
                continue
            done.add(id(param))
            leaf = name.rsplit(".", 2)
            if name.endswith("bias"):
                param.zero_()
            elif isinstance(_owner(module, name), nn.LayerNorm | RMSNorm):
                param.fill_(1.0)
            else:
                std = residual_std if leaf[-2] in ("wo", "fc2", "w2") else INIT_STD
                param.copy_(torch.randn(param.shape, generator=generator) * std)


def _owner(module: nn.Module, param_name: str) -> nn.Module:
    return module.get_submodule(param_name.rpartition(".")[0])


def build_chunk(spec: ModelSpec, start: int, stop: int, *, seed: int,
                dtype: torch.dtype = torch.float32) -> Transformer:
    """Layers [start, stop) of the model, with the weights the whole model would hold."""
    if spec.arch not in ("gpt", "llama"):
        raise ValueError(
            f"model {spec.name!r} has arch {spec.arch!r}: the runtime rebuilds only 'gpt' and "
            "'llama' decoders (a traced custom module cannot be rebuilt); use a catalog model or "
            "an HF config"
        )
    if not 0 <= start < stop <= spec.num_layers:
        raise ValueError(f"layer range [{start}, {stop}) is outside [0, {spec.num_layers})")
    model = Transformer(spec, start, stop)
    layers: list[tuple[int, nn.Module]] = []
    if model.embed is not None:
        layers.append((0, model.embed))
    layers += [(int(key) + 1, block) for key, block in model.blocks.items()]
    if model.head is not None:
        layers.append((spec.num_layers - 1, model.head))
    done: set[int] = set()
    for index, layer in layers:
        generator = torch.Generator().manual_seed(seed * 100_003 + index)  # one stream per layer
        _init_layer(layer, generator, spec.num_blocks, done)
    if spec.tied_embeddings and model.head is not None and model.embed is None:
        # the head of a later pipeline chunk holds a copy of the embedding matrix
        generator = torch.Generator().manual_seed(seed * 100_003)
        with torch.no_grad():
            weight = torch.randn(model.head.out.weight.shape, generator=generator) * INIT_STD
            model.head.out.weight.copy_(weight)
    return model.to(dtype)


def build_model(spec: ModelSpec, *, seed: int, dtype: torch.dtype = torch.float32) -> Transformer:
    """The whole decoder of ``spec`` (arch ``gpt`` or ``llama``), initialised from ``seed``."""
    return build_chunk(spec, 0, spec.num_layers, seed=seed, dtype=dtype)
