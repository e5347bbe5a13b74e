"""Layout: the boxes each rank holds under a Plan, against hand-worked numbers, against the
runtime's parameter names and shapes, and tiling every tensor exactly once per replica."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from meshmorph.elastic.moves.box import Box
from meshmorph.elastic.moves.layout import RNG_STATE_BYTES, Layout, layout_of
from meshmorph.schedule.table import Schedule
from meshmorph.spec.catalog import catalog_model
from meshmorph.spec.model import ModelSpec
from meshmorph.spec.plan import Plan, PlanError
from meshmorph.spec.transformer import TransformerShape, build_transformer


def plan_for(model: ModelSpec, **kw: object) -> Plan:
    return Plan(model=model.name, seq_len=model.seq_len, **kw).with_even_stages(model)  # type: ignore[arg-type]


@st.composite
def models_and_plans(draw: st.DrawFn, max_world: int = 6) -> tuple[ModelSpec, Plan]:
    """A small random gpt/llama model and a valid Plan for it of at most ``max_world`` ranks."""
    arch = draw(st.sampled_from(["gpt", "llama"]))
    heads = draw(st.sampled_from([2, 4]))
    vocab = draw(st.integers(5, 70))
    shape = TransformerShape(
        name="rand", arch=arch, num_layers=draw(st.integers(1, 4)), hidden_size=heads * 4,
        num_heads=heads, num_kv_heads=draw(st.sampled_from([1, heads])) if arch == "llama" else None,
        ffn_hidden_size=draw(st.sampled_from([12, 16, 24])), vocab_size=vocab, seq_len=draw(st.sampled_from([3, 5, 8])),
        tied_embeddings=draw(st.booleans()),
        padded_vocab_size=vocab + draw(st.sampled_from([0, 1, 3])))
    model = build_transformer(shape)
    tp = draw(st.sampled_from([1, 2, 4]))
    pp = draw(st.integers(1, 3))
    vpp = draw(st.sampled_from([1, 2])) if pp > 1 else 1
    dp = draw(st.integers(1, 4))
    assume(tp * pp * dp <= max_world)
    micro = pp * draw(st.integers(1, 2))
    try:
        plan = plan_for(model, tp=tp, pp=pp, vpp=vpp, dp=dp, zero=draw(st.integers(0, 3)),
                        global_batch=dp * micro, num_microbatches=micro,
                        schedule=Schedule.INTERLEAVED if vpp > 1 else Schedule.ONE_F_ONE_B)
        plan.check_against(model)
    except PlanError:
        assume(False)
    return model, plan


def expected_replicas(model: ModelSpec, plan: Plan, layout: Layout, key: str) -> int:
    """How many times the ranks hold each element of ``key``, worked out from the plan."""
    if "/" not in key or key.startswith("rng/"):
        return plan.world_size if "/" not in key else 1
    kind, fqn = key.split("/", 1)
    shape = layout.tensors[key].shape
    vocab = fqn == "embed.tok.weight" or fqn == "head.out.weight"
    split = plan.tp > 1 and (
        (vocab and model.padded_vocab_size % plan.tp == 0)
        or any(f".{n}." in f".{fqn}" for n in ("wq", "wk", "wv", "fc1", "w1", "w3"))
        or (any(f".{n}." in f".{fqn}" for n in ("wo", "fc2", "w2")) and len(shape) == 2))
    sharded = plan.dp > 1 and (plan.zero >= 2 or (plan.zero == 1 and kind != "param"))
    copies = 2 if fqn == "embed.tok.weight" and model.tied_embeddings and plan.pp > 1 else 1
    return (1 if split else plan.tp) * (1 if sharded else plan.dp) * copies


def coverage(layout: Layout, key: str) -> np.ndarray:
    count = np.zeros(layout.tensors[key].shape, dtype=np.int64)
    for _, box in layout.holders(key):
        count[box.slices()] += 1
    return count


@settings(max_examples=150, deadline=None)
@given(models_and_plans())
def test_boxes_tile_every_tensor_exactly_once_per_replica(case: tuple[ModelSpec, Plan]) -> None:
    model, plan = case
    layout = layout_of(model, plan)
    for key in layout.tensors:
        count = coverage(layout, key)
        assert np.all(count == expected_replicas(model, plan, layout, key)), key
    assert sum(layout.bytes_on(r) for r in range(plan.world_size)) == sum(
        layout.tensors[k].nbytes * expected_replicas(model, plan, layout, k) for k in layout.tensors)


def test_zero3_dp4_cuts_rows_like_torch_chunk_with_the_last_rank_empty() -> None:
    model = catalog_model("gpt-tiny", seq_len=6)  # pos.weight has 6 rows: 2, 2, 2, 0 over dp 4
    layout = layout_of(model, plan_for(model, dp=4, zero=3, global_batch=4))
    boxes = [layout.piece(r, "param/embed.pos.weight") for r in range(4)]
    assert [(p.box.offset, p.box.length, p.pad_rows) for p in boxes] == [
        ((0, 0), (2, 64), 0), ((2, 0), (2, 64), 0), ((4, 0), (2, 64), 0), ((6, 0), (0, 64), 2)]
    assert layout.allocated_bytes_on(3) - layout.bytes_on(3) == 2 * 64 * 4 * 3  # param + 2 moments
    assert layout.holders("exp_avg/embed.pos.weight") == [(r, boxes[r].box) for r in range(3)]


def test_zero1_keeps_params_whole_and_shards_moments_of_the_tp_local_rows() -> None:
    model = catalog_model("gpt-tiny", seq_len=16)  # hidden 64, ffn 256
    layout = layout_of(model, plan_for(model, tp=2, dp=2, zero=1, global_batch=2))
    rank = layout.plan.rank_of(0, 1, 1)  # dp 1, tp 1
    fc1 = "blocks.0.mlp.fc1.weight"  # (256, 64), column-parallel: tp 1 holds rows 128..256
    assert layout.piece(rank, f"param/{fc1}").box == Box((128, 0), (128, 64))
    assert layout.piece(rank, f"exp_avg/{fc1}").box == Box((192, 0), (64, 64))
    fc2 = "blocks.0.mlp.fc2.weight"  # (64, 256), row-parallel: tp 1 holds columns 128..256
    assert layout.piece(rank, f"exp_avg_sq/{fc2}").box == Box((32, 128), (32, 128))


def test_tied_head_on_the_last_stage_is_a_replica_of_the_embedding() -> None:
    model = catalog_model("gpt-tiny", seq_len=16)
    assert model.tied_embeddings
    layout = layout_of(model, plan_for(model, pp=2, global_batch=2, num_microbatches=2))
    assert "param/head.out.weight" not in layout.tensors
    assert [r for r, _ in layout.holders("exp_avg/embed.tok.weight")] == [0, 1]
    single = layout_of(model, plan_for(model, global_batch=1))
    assert [r for r, _ in single.holders("param/embed.tok.weight")] == [0]


def test_vocabulary_stays_whole_where_tp_does_not_divide_the_padded_rows() -> None:
    model = build_transformer(TransformerShape(name="odd", arch="gpt", num_layers=2, hidden_size=32,
                                               num_heads=4, vocab_size=251, seq_len=8,
                                               padded_vocab_size=251))
    layout = layout_of(model, plan_for(model, tp=2, global_batch=1))
    assert layout.piece(1, "param/embed.tok.weight").box == Box((0, 0), (251, 32))
    assert layout.piece(1, "param/blocks.0.attn.wq.weight").box == Box((16, 0), (16, 32))


def test_small_state_sits_on_every_rank_and_rng_on_its_own() -> None:
    model = catalog_model("llama-tiny", seq_len=16)
    layout = layout_of(model, plan_for(model, pp=2, dp=2, global_batch=4, num_microbatches=2))
    assert [r for r, _ in layout.holders("data")] == [0, 1, 2, 3]
    assert layout.holders("rng/2") == [(2, Box((0,), (RNG_STATE_BYTES,)))]
    assert layout.tensors["step"].shape == ()


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_param_keys_and_shapes_are_the_one_device_models(name: str) -> None:
    torch = pytest.importorskip("torch")
    from meshmorph.run.model.decoder import build_model

    model = catalog_model(name, seq_len=16)
    with torch.device("meta"):
        module = build_model(model, seed=0, device="meta")
    runtime = {f"param/{n}": tuple(p.shape) for n, p in module.named_parameters()}
    layout = layout_of(model, plan_for(model, global_batch=1))
    assert {k: t.shape for k, t in layout.tensors.items() if k.startswith("param/")} == runtime
