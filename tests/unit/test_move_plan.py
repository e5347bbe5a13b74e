"""MovePlan: its bytes equal the lower bound, its placement is the best of all placements (brute
force up to 6 devices), applying it rebuilds Layout B exactly, and A -> B -> A is bit-identical."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from meshmorph.elastic.moves.layout import DTYPE_BYTES, Layout, layout_of
from meshmorph.elastic.moves.move_plan import FROM_CHECKPOINT, MovePlan, plan_move
from meshmorph.elastic.moves.placement import ReshapeError
from meshmorph.schedule.table import Schedule
from meshmorph.spec.catalog import catalog_model
from meshmorph.spec.model import ModelSpec
from meshmorph.spec.plan import Plan, PlanError
from meshmorph.spec.transformer import TransformerShape, build_transformer
from tests.unit.test_layout import plan_for

GLOBAL_BATCH = 12
NUMPY = {"fp32": np.float32, "int64": np.int64, "uint8": np.uint8}


@st.composite
def plans(draw: st.DrawFn, model: ModelSpec, max_world: int) -> Plan:
    """A valid plan of ``model`` with global batch 12 and at most ``max_world`` ranks."""
    tp, pp = draw(st.sampled_from([1, 2])), draw(st.integers(1, 2))
    dp = draw(st.sampled_from([d for d in (1, 2, 3, 4, 6) if tp * pp * d <= max_world]))
    try:
        plan = plan_for(model, tp=tp, pp=pp, dp=dp, zero=draw(st.integers(0, 3)),
                        global_batch=GLOBAL_BATCH, num_microbatches=GLOBAL_BATCH // dp,
                        schedule=Schedule.GPIPE)
        plan.check_against(model)
    except PlanError:
        assume(False)
    return plan


@st.composite
def reshapes(draw: st.DrawFn, max_devices: int = 6) -> tuple[Layout, Layout, list[int]]:
    """Layouts A and B of one random small model, and the survivors of A (at most 6 devices)."""
    arch = draw(st.sampled_from(["gpt", "llama"]))
    vocab = draw(st.integers(5, 40))
    model = build_transformer(TransformerShape(
        name="rand", arch=arch, num_layers=draw(st.integers(1, 3)), hidden_size=8, num_heads=2,
        ffn_hidden_size=draw(st.sampled_from([8, 12])), vocab_size=vocab, seq_len=5,
        tied_embeddings=draw(st.booleans()), padded_vocab_size=vocab + draw(st.sampled_from([0, 1]))))
    a, b = draw(plans(model, max_devices)), draw(plans(model, max_devices))
    survivors = sorted(draw(st.sets(st.integers(0, a.world_size - 1), min_size=1)))
    assume(max(len(survivors), b.world_size) <= max_devices)
    return layout_of(model, a), layout_of(model, b), survivors


def mask(layout: Layout, rank: int, key: str) -> np.ndarray:
    out = np.zeros(layout.tensors[key].shape, dtype=bool)
    piece = layout.piece(rank, key)
    if piece is not None:
        out[piece.box.slices()] = True
    return out


def brute_force_best(a: Layout, b: Layout, survivors: list[int], devices: tuple[int, ...]) -> int:
    """Fewest bytes any placement receives, by element masks and every injective placement."""
    need = np.zeros((b.world_size, len(devices)), dtype=np.int64)
    for r, (j, d) in itertools.product(range(b.world_size), enumerate(devices)):
        for key in {p.key for p in b.held[r]} & set(a.tensors):
            held = mask(a, d, key) if d in survivors else np.zeros(b.tensors[key].shape, bool)
            need[r, j] += int((mask(b, r, key) & ~held).sum()) * DTYPE_BYTES[b.tensors[key].dtype]
    return min(sum(need[r, j] for r, j in enumerate(cols))
               for cols in itertools.permutations(range(len(devices)), b.world_size))


def truth_of(layout: Layout, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {key: rng.integers(0, 2**31, t.shape).astype(NUMPY[t.dtype]) if t.dtype != "fp32"
            else rng.standard_normal(t.shape).astype(np.float32) for key, t in layout.tensors.items()}


def stores_of(layout: Layout, truth: dict[str, np.ndarray]) -> dict[int, dict[str, np.ndarray]]:
    """Per rank, the arrays it holds (its boxes cut from ``truth``)."""
    return {r: {p.key: truth[p.key][p.box.slices()].copy() for p in layout.held[r]} for r in layout.held}


def apply(move: MovePlan, a: Layout, b: Layout, stores: dict[int, dict[str, np.ndarray]],
          checkpoint: dict[str, np.ndarray]) -> dict[int, dict[str, np.ndarray]]:
    """Run ``move`` in memory: every new rank's arrays from local copies, transfers (read from
    the sender's own arrays only) and checkpoint reads; each element written exactly once."""
    device_rank = {d: r for r, d in move.placement.items()}
    out, written = {}, {}
    for r in move.placement:
        out[r] = {p.key: np.zeros(p.box.length, dtype=NUMPY[b.tensors[p.key].dtype])
                  for p in b.held[r]}
        written[r] = {p.key: np.zeros(p.box.length, dtype=np.int64) for p in b.held[r]}
    for t in (*move.local_copies, *move.transfers, *move.from_checkpoint):
        r = device_rank[t.dst_device]
        dst_box = b.piece(r, t.key).box
        if t.src_device == FROM_CHECKPOINT:
            value = checkpoint[t.key][t.box.slices()]
        else:
            src_box = a.piece(t.src_device, t.key).box
            assert t.src_device in move.survivors and src_box.contains(t.box)
            local = tuple(slice(o - so, o - so + n) for o, so, n in
                          zip(t.box.offset, src_box.offset, t.box.length, strict=True))
            value = stores[t.src_device][t.key][local]
        at = tuple(slice(o - do, o - do + n) for o, do, n in
                   zip(t.box.offset, dst_box.offset, t.box.length, strict=True))
        out[r][t.key][at] = value
        written[r][t.key][at] += 1
    for r in out:
        for key in out[r]:
            if key in move.fresh_keys:
                continue
            assert np.all(written[r][key] == 1), (r, key)
    return out


@settings(max_examples=60, deadline=None)
@given(reshapes())
def test_bytes_moved_equal_the_lower_bound_of_the_best_placement_by_brute_force(
        case: tuple[Layout, Layout, list[int]]) -> None:
    a, b, survivors = case
    move = plan_move(a, b, survivors)
    best = brute_force_best(a, b, survivors, move.devices)
    assert move.lower_bound_bytes == best
    assert move.bytes_moved == best
    assert move.naive_bytes >= best
    assert all(batch.nbytes <= move.staging_bytes for batch in move.batches)


@settings(max_examples=40, deadline=None)
@given(reshapes(), st.integers(0, 2**16))
def test_applying_the_move_rebuilds_layout_b_and_a_round_trip_is_bit_identical(
        case: tuple[Layout, Layout, list[int]], seed: int) -> None:
    a, b, survivors = case
    truth = truth_of(a, seed)
    fresh = {k: v for k, v in truth_of(b, seed + 1).items() if k not in truth}
    there = plan_move(a, b, survivors, staging_bytes=256)
    on_b = apply(there, a, b, stores_of(a, truth), truth)
    for r, arrays in on_b.items():
        for p in b.held[r]:
            if p.key not in fresh:
                assert np.array_equal(arrays[p.key], truth[p.key][p.box.slices()]), (r, p.key)
            else:
                arrays[p.key][...] = fresh[p.key][p.box.slices()]
    back = plan_move(b, a, list(range(b.world_size)))
    on_a = apply(back, b, a, on_b, {**truth, **fresh})
    for r, arrays in on_a.items():
        for p in a.held[r]:
            if p.key in b.tensors:  # state B never had (a leaving rank's RNG) is not kept
                assert arrays[p.key].tobytes() == truth[p.key][p.box.slices()].tobytes()


def gpt(seq_len: int = 16) -> ModelSpec:
    return catalog_model("gpt-tiny", seq_len=seq_len)


def test_same_plan_on_all_ranks_moves_nothing() -> None:
    layout = layout_of(gpt(), plan_for(gpt(), tp=2, dp=2, zero=3, global_batch=4, micro_batch=2))
    move = plan_move(layout, layout, [0, 1, 2, 3])
    assert (move.bytes_moved, move.messages, move.placement) == (0, 0, {r: r for r in range(4)})


def test_two_replicas_share_the_sending_to_two_joining_devices() -> None:
    model = gpt()
    a = layout_of(model, plan_for(model, dp=2, global_batch=4, num_microbatches=2))
    b = layout_of(model, plan_for(model, dp=4, global_batch=4))
    move = plan_move(a, b, [0, 1])
    state = sum(t.nbytes for k, t in a.tensors.items() if not k.startswith("rng/"))
    row = max(t.nbytes // t.shape[0] for t in a.tensors.values() if t.shape)
    sent = move.sent_bytes()
    assert move.bytes_moved == move.lower_bound_bytes == 2 * state  # rng/2, rng/3 are fresh
    assert move.fresh_keys == ("rng/2", "rng/3")
    assert abs(sent[0] - state) <= row and abs(sent[1] - state) <= row
    assert move.devices == (0, 1, 2, 3) and move.placement == {0: 0, 1: 1, 2: 2, 3: 3}


def test_pieces_only_dead_ranks_held_come_from_the_checkpoint() -> None:
    model = gpt()
    a = layout_of(model, plan_for(model, dp=4, zero=3, global_batch=4))
    b = layout_of(model, plan_for(model, dp=2, zero=3, global_batch=4, micro_batch=2))
    move = plan_move(a, b, [0, 1])
    lost = sum(a.bytes_on(r) for r in (2, 3)) - 2 * (3 * 8 + 5056)  # less small state and rng
    assert move.checkpoint_bytes == lost
    assert move.bytes_moved == move.lower_bound_bytes
    planned = plan_move(a, b, [0, 1, 2, 3])  # a planned change: 2 and 3 send before they go
    assert planned.checkpoint_bytes == 0 and set(planned.placement.values()) <= {0, 1, 2, 3}


def test_best_placement_beats_rank_order_when_a_middle_rank_dies() -> None:
    model = gpt()
    a = layout_of(model, plan_for(model, tp=2, dp=2, global_batch=2))
    b = layout_of(model, plan_for(model, tp=2, global_batch=2, num_microbatches=2))
    move = plan_move(a, b, [0, 2, 3])  # rank 1 (dp 0, tp 1) is gone; rank 3 holds the same box
    assert move.placement == {0: 0, 1: 3}
    assert move.bytes_moved == move.lower_bound_bytes == move.checkpoint_bytes == 5056  # rng/1
    assert move.naive_bytes > 10 * move.bytes_moved


def test_reshape_between_models_or_global_batches_is_refused() -> None:
    a = layout_of(gpt(), plan_for(gpt(), dp=2, global_batch=2))
    other = catalog_model("llama-tiny", seq_len=16)
    with pytest.raises(ReshapeError, match="keeps the model"):
        plan_move(a, layout_of(other, plan_for(other, dp=2, global_batch=2)), [0, 1])
    with pytest.raises(ReshapeError, match="global_batch 4 differs"):
        plan_move(a, layout_of(gpt(), plan_for(gpt(), dp=2, global_batch=4, num_microbatches=2)), [0, 1])
    with pytest.raises(ReshapeError, match=r"outside the old plan's ranks 0\.\.1"):
        plan_move(a, a, [0, 5])
    with pytest.raises(ReshapeError, match="needs 2 devices but only 1"):
        plan_move(a, a, [0], new_devices=[])


def test_a_planned_leave_places_the_new_ranks_on_the_staying_devices_at_their_lower_bound() -> None:
    model = gpt()
    a = layout_of(model, plan_for(model, dp=4, zero=3, global_batch=4))
    b = layout_of(model, plan_for(model, dp=2, zero=3, global_batch=4, micro_batch=2))
    free = plan_move(a, b, [0, 1, 2, 3])
    staying = plan_move(a, b, [0, 1, 2, 3], hosts=[0, 3])  # 1 and 2 leave after sending
    assert set(staying.placement.values()) == {0, 3} and staying.checkpoint_bytes == 0
    assert staying.bytes_moved == staying.lower_bound_bytes == brute_force_best(
        a, b, [0, 1, 2, 3], (0, 3))
    assert staying.lower_bound_bytes >= free.lower_bound_bytes
    assert staying.naive_placement == {0: 0, 1: 3}
    with pytest.raises(ReshapeError, match="hosts"):
        plan_move(a, b, [0, 1, 2, 3], hosts=[0, 7])
