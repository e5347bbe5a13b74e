"""Reference models: shapes, exact parameter counts against ModelSpec, seeded initialisation,
grouped-query attention, pipeline chunks and per-layer recompute."""

from __future__ import annotations

import pytest
import torch

from meshmorph.run.model import decoder as models
from meshmorph.run.model.decoder import build_chunk, build_model
from meshmorph.run.parallel.recompute import apply_recompute
from meshmorph.spec.catalog import catalog_model
from meshmorph.spec.model import ModelSpec, Recompute
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


def _odd_vocab(padded: int | None) -> ModelSpec:
    return build_transformer(TransformerShape(name="odd", arch="gpt", num_layers=2, hidden_size=16,
                                              num_heads=2, vocab_size=251, seq_len=8,
                                              padded_vocab_size=padded))


def test_vocabulary_is_padded_to_a_multiple_of_128_and_priced() -> None:
    padded, plain = _odd_vocab(None), _odd_vocab(251)
    assert (padded.vocab_size, padded.padded_vocab_size) == (251, 256)
    assert (plain.vocab_size, plain.padded_vocab_size) == (251, 251)
    assert padded.num_params - plain.num_params == 5 * 16  # 5 padded rows, the head tied
    assert padded.layers[-1].fwd_flops_per_token == 2.0 * 16 * 256
    assert catalog_model("gpt-tiny").padded_vocab_size == 256  # already a multiple: unchanged
    assert catalog_model("gpt3-125m").padded_vocab_size == 50304


def test_padded_vocabulary_leaves_logits_loss_and_real_gradients_unchanged() -> None:
    """Padding changes the head's backward GEMM only by zero terms in its sum over the vocabulary;
    BLAS may block a 256-long sum differently from a 251-long one, so the check runs in float64,
    where that re-association moves a gradient by ~1e-16 relative while any real change (a pad
    logit leaking into the softmax, a pad row read) moves it by far more than 1e-12."""
    from meshmorph.run.model.loss import token_cross_entropy

    tokens = torch.randint(0, 251, (2, 9), generator=torch.Generator().manual_seed(0))
    grads, losses = [], []
    for spec in (_odd_vocab(None), _odd_vocab(251)):
        model = build_model(spec, seed=4).double()
        logits = model(tokens[:, :-1])
        assert logits.shape == (2, 8, 251)  # only the real logits leave the head
        loss = token_cross_entropy(logits, tokens[:, 1:])
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append({k: p.grad for k, p in model.named_parameters()})
    padded, plain = grads
    assert losses[0] == losses[1]
    assert torch.count_nonzero(padded["embed.tok.weight"][251:]) == 0  # never indexed, never read
    padded["embed.tok.weight"] = padded["embed.tok.weight"][:251]
    for name in plain:
        torch.testing.assert_close(padded[name], plain[name], rtol=1e-12, atol=1e-15, msg=name)


def test_padded_vocabulary_rows_start_at_zero() -> None:
    model = build_model(_odd_vocab(None), seed=2)
    assert model.embed.tok.weight.shape == (256, 16)
    assert torch.count_nonzero(model.embed.tok.weight[251:]) == 0
    assert torch.count_nonzero(model.embed.tok.weight[:251]) == 251 * 16


def test_meta_chunk_allocates_nothing_until_materialized() -> None:
    from meshmorph.run.model.materialize import materialize_

    spec = catalog_model("llama-tiny")
    chunk = build_chunk(spec, 3, spec.num_layers, seed=9, device="meta")
    assert all(p.is_meta for p in chunk.parameters())
    materialize_(chunk, spec, seed=9, device="cpu")
    reference = build_chunk(spec, 3, spec.num_layers, seed=9)
    for (name, a), b in zip(chunk.named_parameters(), reference.parameters(), strict=True):
        assert a.device.type == "cpu", name
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="build it with build_chunk"):
        materialize_(chunk, spec, seed=9, device="cpu")


def test_tied_head_copy_on_a_later_chunk_starts_as_the_embedding() -> None:
    spec = catalog_model("gpt-tiny")
    first = build_chunk(spec, 0, 2, seed=3)
    last = build_chunk(spec, 2, spec.num_layers, seed=3, device="meta")
    from meshmorph.run.model.materialize import materialize_

    materialize_(last, spec, seed=3, device="cpu")
    assert torch.equal(last.head.out.weight, first.embed.tok.weight)


def test_every_parameter_has_its_own_stream() -> None:
    spec = catalog_model("llama-tiny")
    shape = (8, 4)
    a = models.init_value(spec, 1, "attn.wq.weight", shape, seed=0)
    b = models.init_value(spec, 1, "attn.wk.weight", shape, seed=0)
    c = models.init_value(spec, 2, "attn.wq.weight", shape, seed=0)
    assert not torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(a, models.init_value(spec, 1, "attn.wq.weight", shape, seed=0))
    residual = models.init_value(spec, 1, "attn.wo.weight", (256, 256), seed=0)
    assert abs(float(residual.std()) - 0.02 / (2 * 4) ** 0.5) < 3e-4  # GPT-2 scaled init
    assert torch.equal(models.init_value(spec, 1, "attn_norm.weight", (4,), seed=0),
                       torch.ones(4))


def test_init_rows_per_block_is_fixed_by_the_shape_at_one_mib() -> None:
    assert models.init_rows_per_block((4096, 1024)) == 256  # 256 rows x 4 KiB = 1 MiB
    assert models.init_rows_per_block((1024, 4096)) == 64
    assert models.init_rows_per_block((3, 2**20)) == 1  # a row over 1 MiB is its own block
    assert models.init_rows_per_block((1_000_000,)) == 2**18  # a vector: 2^18 fp32 per block


def test_init_boxes_drawn_alone_equal_the_same_boxes_of_the_whole_value() -> None:
    spec = catalog_model("gpt-tiny")
    shape = (600, 1024)  # blocks of 256 rows: [0, 256), [256, 512), [512, 600)
    whole = models.init_value(spec, 1, "mlp.fc2.weight", shape, seed=7)
    assert abs(float(whole.std()) - 0.02 / (2 * 4) ** 0.5) < 3e-5  # residual scaling kept
    blocks = [models.init_value(spec, 1, "mlp.fc2.weight", shape, seed=7, box=(rows, slice(None)))
              for rows in (slice(0, 256), slice(256, 512), slice(512, 600))]
    assert torch.equal(torch.cat(blocks), whole)
    for box in [(slice(250, 520), slice(None)),  # rows across two block bounds (a dim-0 shard)
                (slice(None), slice(100, 612)),  # a column split (row-parallel weight)
                (slice(255, 257), slice(1000, 1024)),  # a 2x24 box across one bound
                (slice(599, 600), slice(None)), (slice(600, 600), slice(None))]:  # last, empty
        part = models.init_value(spec, 1, "mlp.fc2.weight", shape, seed=7, box=box)
        assert torch.equal(part, whole[box]), box
        out = torch.full(whole[box].shape, float("nan"))
        models.fill_init_value_(out, spec, 1, "mlp.fc2.weight", shape, seed=7, box=box)
        assert torch.equal(out, whole[box]), box
    assert not torch.equal(whole[:256], whole[256:512])  # every block its own generator


def test_init_draws_only_the_blocks_a_box_overlaps_one_at_a_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    spec = catalog_model("gpt-tiny")
    drawn: list[int] = []
    randn = torch.randn

    def counting_randn(*args: object, **kwargs: object) -> torch.Tensor:
        value = randn(*args, **kwargs)  # type: ignore[call-overload]
        drawn.append(value.numel())
        return value

    monkeypatch.setattr(models.torch, "randn", counting_randn)
    models.init_value(spec, 1, "mlp.fc1.weight", (4096, 1024), seed=0, box=(slice(300, 310),
                                                                             slice(None)))
    assert drawn == [256 * 1024]  # the one block holding rows 300..309
    drawn.clear()
    models.init_value(spec, 1, "mlp.fc2.weight", (1024, 4096), seed=0, box=(slice(None),
                                                                            slice(0, 2048)))
    assert drawn == [64 * 4096] * 16  # a column split: every block, 1 MiB each, one at a time


def test_vocabulary_blocks_draw_only_real_rows_so_padding_keeps_the_real_values() -> None:
    padded, plain = _odd_vocab(None), _odd_vocab(251)  # vocabulary 251, padded to 256 or not
    shape = (256, 2048)  # blocks of 128 rows: the second holds rows 128..250 and 5 padded rows
    whole = models.init_value(padded, 0, "tok.weight", shape, seed=1)
    assert torch.count_nonzero(whole[251:]) == 0
    assert torch.count_nonzero(whole[:251]) == 251 * 2048
    assert torch.equal(whole[:251], models.init_value(plain, 0, "tok.weight", (251, 2048), seed=1))
    head = padded.num_layers - 1  # the tied head's copy
    tail = models.init_value(padded, head, "out.weight", shape, seed=1,
                             box=(slice(200, 256), slice(0, 64)))
    assert torch.equal(tail, whole[200:, :64])
