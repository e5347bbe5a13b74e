"""Tracing an nn.Module on the meta device: parameters, FLOPs and saved activations per layer."""

from __future__ import annotations

import math
import resource
from pathlib import Path

import pytest
import torch
from torch import nn

from meshmorph.spec import LayerKind, Recompute, TransformerShape, build_transformer, load_model
from meshmorph.spec.trace import trace_factory

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
HERE = __name__  # the factories below are importable as f"{HERE}:function"


class Attention(nn.Module):
    """Causal self-attention with explicit matmuls over the full s x s score matrix."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.num_heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = (t.view(b, s, self.num_heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(h // self.num_heads)
        causal = torch.ones(s, s, dtype=torch.bool).triu(1)  # no device: the tracer's meta default
        out = scores.masked_fill(causal, float("-inf")).softmax(-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, s, h))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    """GPT-2 layout: token + learned position embeddings, blocks, final LayerNorm, tied head."""

    def __init__(self, vocab: int, width: int, heads: int, depth: int, positions: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(positions, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def tiny_gpt() -> TinyGPT:
    return TinyGPT(vocab=512, width=64, heads=4, depth=3, positions=128)


def tiny_gpt_wide() -> TinyGPT:
    return TinyGPT(vocab=512, width=128, heads=4, depth=3, positions=128)


class FusedBlock(nn.Module):
    """Attention through F.scaled_dot_product_attention, as modern models write it."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.n_head = heads
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = (t.view(b, s, self.n_head, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        y = nn.functional.scaled_dot_product_attention(q, k, v, None, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(b, s, h))


def sdpa_model() -> nn.Module:
    blocks = (FusedBlock(64, 8) for _ in range(2))
    return nn.Sequential(nn.Embedding(300, 64), *blocks, nn.Linear(64, 300, bias=False))


BUILT: list[nn.Module] = []


def huge_gpt() -> TinyGPT:
    """13.3e9 parameters: 53 GB in fp32, more than this machine could hold."""
    model = TinyGPT(vocab=50304, width=8192, heads=64, depth=16, positions=2048)
    BUILT.append(model)
    return model


def mlp_sequential() -> nn.Sequential:
    return nn.Sequential(nn.Embedding(100, 32), nn.Linear(32, 96), nn.GELU(), nn.Linear(96, 100))


def not_a_module() -> int:
    return 3


def needs_width(width: int) -> nn.Module:
    return nn.Linear(width, width)


def float_input_only() -> nn.Module:
    return nn.LSTM(8, 8)  # token ids are not a valid LSTM input


def _gpt_shape(width: int, seq: int) -> TransformerShape:
    return TransformerShape(name="ref", arch="gpt", num_layers=3, hidden_size=width, num_heads=4,
                            vocab_size=512, seq_len=seq)


def test_tiny_gpt_params_and_flops_equal_gpt_formulas_layer_by_layer():
    traced = trace_factory(f"{HERE}:tiny_gpt", seq_len=128, batch=2)
    reference = build_transformer(_gpt_shape(64, 128))  # learned positions for s = 128 = positions
    assert traced.num_params == reference.num_params == sum(p.numel() for p in tiny_gpt().parameters())
    assert [layer.name for layer in traced.layers] == [layer.name for layer in reference.layers]
    for ours, ref in zip(traced.layers, reference.layers, strict=True):
        assert (ours.kind, ours.params, ours.tied_params) == (ref.kind, ref.params, ref.tied_params)
        # blocks: 24h^2 + 4sh; head: 2hV; embedding: 0 (hand-counted matmul FLOPs)
        assert ours.fwd_flops_per_token == pytest.approx(ref.fwd_flops_per_token, rel=1e-2)
    h, s, v = 64, 128, 512
    assert traced.layers[1].fwd_flops_per_token == 24 * h * h + 4 * s * h
    assert traced.layers[-1].fwd_flops_per_token == 2 * h * v
    assert traced.layers[-1].tied_params == v * h and traced.tied_embeddings


def test_tiny_gpt_shape_fields_come_from_the_module():
    traced = trace_factory(f"{HERE}:tiny_gpt", seq_len=64)
    assert (traced.arch, traced.tp_splittable, traced.seq_len, traced.dtype_bytes) == ("custom", False, 64, 2)
    assert (traced.hidden_size, traced.num_heads, traced.num_kv_heads) == (64, 4, 4)
    assert (traced.ffn_hidden_size, traced.vocab_size, traced.num_blocks) == (256, 512, 3)
    block = traced.layers[1]
    assert block.recompute_flops_per_token == {Recompute.NONE: 0.0, Recompute.FULL: block.fwd_flops_per_token}
    # full recompute keeps the block input: [b, s, h] in bf16 = 2h bytes per token
    assert block.activation[Recompute.FULL].shared == 2 * 64


def test_saved_activation_bytes_are_positive_and_grow_with_width():
    narrow = trace_factory(f"{HERE}:tiny_gpt", seq_len=128).layers[1].activation[Recompute.NONE]
    wide = trace_factory(f"{HERE}:tiny_gpt_wide", seq_len=128).layers[1].activation[Recompute.NONE]
    assert narrow.shared > 0 and narrow.split == 0.0 and wide.shared > narrow.shared
    s, a = 128, 4
    for h, saved in ((64, narrow), (128, wide)):
        # per token, bf16 unless noted: two LayerNorm inputs 2*2h + their fp32 mean and rstd 2*8,
        # qkv input 2h, q/k/v (one qkv output storage) 6h, the bool causal mask s*s / s = s,
        # softmax output 2as, proj input 2h, fc1 input 2h, GeLU input 8h, fc2 input 8h
        assert saved.shared == 32 * h + 16 + s + 2 * a * s


def test_mlp_block_saves_exactly_its_three_activations_and_head_its_fp32_logits():
    spec = trace_factory(f"{EXAMPLES / 'models' / 'tiny_mlp.py'}:build", seq_len=32, batch=2)
    h, v = 64, 256
    blocks = [layer for layer in spec.layers if layer.kind == LayerKind.BLOCK]
    assert len(blocks) == 4 and spec.num_params == v * h + 4 * (8 * h * h + 5 * h) + h * v
    for block in blocks:
        # Linear input 2h + GeLU input 8h + second Linear input 8h, in bf16
        assert block.activation[Recompute.NONE].shared == 18 * h
        assert block.fwd_flops_per_token == 2 * 2 * h * 4 * h
    head = spec.layers[-1].activation[Recompute.NONE].shared
    tokens = 2 * 32
    # head Linear input 2h + fp32 log-probabilities 4V + the loss's 4-byte total weight
    assert head == 2 * h + 4 * v + 4 / tokens


def test_sdpa_is_traced_as_the_fused_kernel_that_keeps_no_scores():
    spec = trace_factory(f"{HERE}:sdpa_model", seq_len=256, batch=2)
    h, a, s = 64, 8, 256
    # no ModuleList: one layer per child of the Sequential
    assert [layer.name for layer in spec.layers] == ["layer.0", "layer.1", "layer.2", "layer.3"]
    for block in spec.layers[1:3]:
        assert block.kind == LayerKind.BLOCK
        # qkv and out projections 2*4h^2, QK^T and AV over the full s x s matrix 4sh
        assert block.fwd_flops_per_token == 8 * h * h + 4 * s * h
        # qkv input 2h, q/k/v 6h, output 2h (the out projection's input too), fp32 log-sum-exp 4a
        assert block.activation[Recompute.NONE].shared == 10 * h + 4 * a
    assert (spec.num_heads, spec.vocab_size, spec.hidden_size) == (8, 300, 64)


def test_flops_per_token_do_not_depend_on_batch():
    one = trace_factory(f"{HERE}:tiny_gpt", seq_len=32, batch=1)
    three = trace_factory(f"{HERE}:tiny_gpt", seq_len=32, batch=3)
    assert [lay.fwd_flops_per_token for lay in one.layers] == [lay.fwd_flops_per_token for lay in three.layers]


def test_module_without_module_list_has_one_layer_per_top_level_child():
    spec = trace_factory(f"{HERE}:mlp_sequential", seq_len=16)
    assert [layer.name for layer in spec.layers] == ["layer.0", "layer.1", "layer.2", "layer.3"]
    assert [layer.kind for layer in spec.layers] == [
        LayerKind.EMBEDDING, LayerKind.BLOCK, LayerKind.BLOCK, LayerKind.HEAD]
    assert [layer.params for layer in spec.layers] == [3200, 32 * 96 + 96, 0, 96 * 100 + 100]
    assert [layer.fwd_flops_per_token for layer in spec.layers] == [0, 2 * 32 * 96, 0, 2 * 96 * 100]
    assert spec.hidden_size == 32 and spec.vocab_size == 100


def test_model_larger_than_memory_is_traced_without_allocating_it():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    spec = trace_factory(f"{HERE}:huge_gpt", seq_len=2048)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    h, v, L, s = 8192, 50304, 16, 2048
    assert spec.num_params == L * (12 * h * h + 13 * h) + v * h + s * h + 2 * h == 13_315_489_792
    assert all(p.is_meta for p in BUILT[-1].parameters())
    assert grown_mib < 512
    assert spec.layers[1].fwd_flops_per_token == 24 * h * h + 4 * s * h


def test_load_model_routes_a_factory_to_the_tracer():
    spec = load_model(f"{HERE}:tiny_gpt", seq_len=16)
    assert (spec.arch, spec.seq_len, spec.name) == ("custom", 16, f"{HERE}:tiny_gpt")
    with pytest.raises(ValueError, match="traced at seq_len 16; trace it again"):
        spec.with_seq_len(32)


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("no_colon_here", "expected package.module:function"),
        ("meshmorph_no_such_module:build", "cannot import 'meshmorph_no_such_module'"),
        (f"{HERE}:no_such_function", "has no function 'no_such_function'"),
        (f"{HERE}:not_a_module", "returned int, not an nn.Module"),
        (f"{HERE}:needs_width", r"must be callable with no arguments \(missing a required argument: 'width'\)"),
        (f"{HERE}:float_input_only", r"failed forward on token ids LongTensor\[1, 8\]"),
        ("missing/file.py:build", "cannot import 'missing/file.py'"),
    ],
)
def test_bad_factory_targets_get_a_clear_error_naming_them(target, message):
    with pytest.raises(ValueError, match=message):
        trace_factory(target, seq_len=8)


def test_bad_trace_settings_are_refused():
    with pytest.raises(ValueError, match="seq_len and batch must be positive, got seq_len=0 batch=1"):
        trace_factory(f"{HERE}:tiny_gpt", seq_len=0)
    with pytest.raises(ValueError, match="seq_len and batch must be positive, got seq_len=8 batch=-2"):
        trace_factory(f"{HERE}:tiny_gpt", seq_len=8, batch=-2)
