"""Reference models: shapes, exact parameter counts against ModelSpec, seeded initialisation,
grouped-query attention, pipeline chunks and per-layer recompute."""

from __future__ import annotations

import pytest
import torch

from meshmorph.run import models
from meshmorph.run.models import build_chunk, build_model
from meshmorph.run.recompute import apply_recompute
from meshmorph.spec.catalog import catalog_model
from meshmorph.spec.model import Recompute
from meshmorph.spec.transformer import TransformerShape, build_transformer


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_forward_maps_tokens_to_vocab_logits(name: str) -> None:
    spec = catalog_model(name)
    model = build_model(spec, seed=0)
    tokens = torch.randint(0, spec.vocab_size, (3, spec.seq_len))
    assert model(tokens).shape == (3, spec.seq_len, spec.vocab_size)


@pytest.mark.parametrize(("name", "expected"), [("gpt-tiny", 218_496), ("llama-tiny", 229_952)])
def test_param_count_equals_model_spec_exactly(name: str, expected: int) -> None:
    spec = catalog_model(name)
    model = build_model(spec, seed=0)
    assert spec.num_params == expected
    assert sum(p.numel() for p in model.parameters()) == expected  # a tied head counted once


def test_gpt_head_is_tied_to_the_token_embedding() -> None:
    model = build_model(catalog_model("gpt-tiny"), seed=0)
    assert model.head.out.weight is model.embed.tok.weight


def test_module_tree_mirrors_spec_layers() -> None:
    spec = catalog_model("llama-tiny")
    model = build_model(spec, seed=0)
    assert list(model.blocks) == ["0", "1", "2", "3"]
    assert "blocks.3.attn.wq.weight" in model.state_dict()
    assert model.embed.pos is None  # rotary positions: no learned position table


def test_same_seed_gives_bitwise_same_weights_and_another_seed_does_not() -> None:
    spec = catalog_model("gpt-tiny")
    a, b, c = (build_model(spec, seed=s).state_dict() for s in (5, 5, 6))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["blocks.0.attn.wq.weight"], c["blocks.0.attn.wq.weight"])


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_chunk_holds_exactly_the_whole_models_weights_for_its_layers(name: str) -> None:
    spec = catalog_model(name)
    whole = build_model(spec, seed=3).state_dict()
    first, last = build_chunk(spec, 0, 3, seed=3), build_chunk(spec, 3, spec.num_layers, seed=3)
    assert first.head is None and last.embed is None
    assert sorted(first.blocks) == ["0", "1"] and sorted(last.blocks) == ["2", "3"]
    merged = {**first.state_dict(), **last.state_dict()}
    assert sorted(merged) == sorted(whole)
    assert all(torch.equal(merged[k], whole[k]) for k in whole)  # tied head copy included


def test_chunks_chained_give_the_whole_models_logits() -> None:
    spec = catalog_model("llama-tiny")
    tokens = torch.randint(0, spec.vocab_size, (2, spec.seq_len))
    whole = build_model(spec, seed=1)(tokens)
    chained = build_chunk(spec, 2, 6, seed=1)(build_chunk(spec, 0, 2, seed=1)(tokens))
    torch.testing.assert_close(chained, whole, rtol=0, atol=0)


def test_gqa_projects_fewer_key_value_heads() -> None:
    spec = catalog_model("llama-tiny")  # 4 heads, 2 kv heads, head_dim 16
    attn = build_model(spec, seed=0).blocks["0"].attn
    assert attn.wq.weight.shape == (64, 64)
    assert attn.wk.weight.shape == (32, 64)
    assert attn.wv.weight.shape == (32, 64)
    x = torch.randn(2, spec.seq_len, 64)
    assert attn(x).shape == (2, spec.seq_len, 64)


def test_gqa_equals_attention_with_repeated_key_value_heads() -> None:
    core = models.AttentionCore()
    q = torch.randn(1, 4, 8, 16)
    kv = torch.randn(1, 2, 8, 16)
    repeated = kv.repeat_interleave(2, dim=1)
    torch.testing.assert_close(core(q, kv, kv), core(q, repeated, repeated))


def test_custom_arch_is_refused_with_a_way_out() -> None:
    spec = catalog_model("gpt-tiny")
    import dataclasses

    custom = dataclasses.replace(spec, arch="custom")
    with pytest.raises(ValueError, match="traced custom module cannot be rebuilt"):
        build_model(custom, seed=0)


def _count_calls(monkeypatch: pytest.MonkeyPatch, mode: Recompute) -> tuple[int, int]:
    """(attention-core calls, wq calls) over one forward and backward of a 1-block GPT."""
    spec = build_transformer(TransformerShape(name="one", arch="gpt", num_layers=1, hidden_size=16,
                                              num_heads=2, vocab_size=32, seq_len=8))
    model = build_model(spec, seed=0)
    apply_recompute(model, 0, (Recompute.NONE, mode, Recompute.NONE))
    calls = {"core": 0, "wq": 0}
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting_sdpa(*args: object, **kwargs: object) -> torch.Tensor:
        calls["core"] += 1
        return sdpa(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(models.F, "scaled_dot_product_attention", counting_sdpa)
    model.blocks["0"].attn.wq.register_forward_hook(
        lambda *_: calls.__setitem__("wq", calls["wq"] + 1))
    model(torch.randint(0, 32, (2, 8))).sum().backward()
    return calls["core"], calls["wq"]


def test_recompute_modes_rerun_exactly_their_part_in_backward(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert _count_calls(monkeypatch, Recompute.NONE) == (1, 1)
    assert _count_calls(monkeypatch, Recompute.SELECTIVE) == (2, 1)  # attention core only
    assert _count_calls(monkeypatch, Recompute.FULL) == (2, 2)  # the whole block


def test_recompute_leaves_parameter_names_and_gradients_unchanged() -> None:
    spec = catalog_model("gpt-tiny", seq_len=8)
    tokens = torch.randint(0, spec.vocab_size, (2, 8))
    plain, checkpointed = build_model(spec, seed=0), build_model(spec, seed=0)
    n, f, s = Recompute.NONE, Recompute.FULL, Recompute.SELECTIVE
    apply_recompute(checkpointed, 0, (n, f, s, f, s, n))
    for model in (plain, checkpointed):
        model(tokens).square().mean().backward()
    assert list(dict(plain.named_parameters())) == list(dict(checkpointed.named_parameters()))
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, msg=name)
