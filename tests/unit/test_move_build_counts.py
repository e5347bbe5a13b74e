"""What a rank of a plan builds (``elastic/moves/build_counts.py``) against the modules the runtime
builds on the meta device and the bytes the Layout allocates; and the move time's build,
install and parts priced from those counts (hand-computed)."""

from __future__ import annotations

import pytest

from meshmorph.elastic.moves.build_counts import build_counts
from meshmorph.elastic.moves.layout import layout_of
from meshmorph.elastic.moves.move_plan import plan_move
from meshmorph.elastic.moves.move_time import PARTS, MoveTimeModel, move_time
from meshmorph.spec.catalog import catalog_model
from meshmorph.spec.cluster import parse_cluster
from tests.unit.test_layout import plan_for

PLANS = [dict(dp=4, zero=3, global_batch=8, num_microbatches=2),
         dict(pp=2, dp=2, global_batch=8, num_microbatches=4),
         dict(tp=2, pp=2, global_batch=8, micro_batch=2, num_microbatches=4),
         dict(tp=2, dp=2, global_batch=8, micro_batch=2, num_microbatches=2),
         dict(dp=2, zero=3, global_batch=8, num_microbatches=4)]


@pytest.mark.parametrize("kw", PLANS, ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_counts_match_the_meta_modules_and_the_layout(kw: dict) -> None:
    from meshmorph.run.model.decoder import build_chunk

    model = catalog_model("gpt-tiny", seq_len=16)
    plan = plan_for(model, **kw)
    layout = layout_of(model, plan)
    counts = build_counts(model, plan)
    assert sorted(counts) == list(range(plan.world_size))
    for rank, c in counts.items():
        pp_rank = next(p for p in range(plan.pp) for d in range(plan.dp)
                       for t in range(plan.tp) if plan.rank_of(p, d, t) == rank)
        built = [build_chunk(model, plan.stages[i].start, plan.stages[i].stop, seed=0,
                             device="meta") for i in plan.chunks_of(pp_rank)]
        assert c.tensors == sum(len(list(chunk.parameters())) for chunk in built)
        params = [p for p in layout.held[rank] if p.key.startswith("param/")]
        assert c.tensors == len(params)
        assert c.param_bytes == sum(4 * (p.box.numel + p.pad_rows * p.box.row_numel())
                                    for p in params)
        split = [p for p in params if p.box.length != layout.tensors[p.key].shape]
        fsdp = plan.dp > 1 and plan.zero >= 2
        if not fsdp:  # every box a TP split leaves short of its tensor
            assert c.tp_tensors == len(split)
        assert c.fsdp_tensors == (c.tensors if fsdp else 0)
        layers = sum(plan.stages[i].stop - plan.stages[i].start for i in plan.chunks_of(pp_rank))
        assert c.fsdp_units == (layers + len(plan.chunks_of(pp_rank)) if fsdp else 0)
        # init_device_mesh: a new_group call per group of every dimension smaller than the
        # world; this rank joins the one of each such dimension that holds it
        dims = [n for n in (plan.pp, plan.dp, plan.tp) if n < plan.world_size]
        assert c.mesh_calls == sum(plan.world_size // n for n in dims)
        assert sorted(c.mesh_groups) == sorted(n for n in dims if n > 1)


def test_build_install_and_parts_are_priced_from_the_counts() -> None:
    model = catalog_model("gpt-tiny", seq_len=16)
    plan_a = plan_for(model, dp=4, zero=3, global_batch=8, num_microbatches=2)
    plan_b = plan_for(model, tp=2, pp=2, global_batch=8, micro_batch=2, num_microbatches=4)
    move = plan_move(layout_of(model, plan_a), layout_of(model, plan_b), [0, 1, 2, 3])
    counts = build_counts(model, plan_b)
    terms = MoveTimeModel(fixed_s=0.01, p2p_alpha_s=1e-3, p2p_beta_s_per_byte=1e-9,
                          plan_s=0.02, agree_s=0.003, agree_s_per_byte=1e-8, group_s=0.04,
                          group_call_s=0.002, mesh_group_s=0.03, state_tensor_s=1e-4, state_call_s=5e-3,
                          meta_tensor_s=5e-4, tp_tensor_s=2e-3, fsdp_unit_s=3e-3,
                          fsdp_tensor_s=1e-3, materialize_tensor_s=7e-4, zero_bps=2e9,
                          copy_bps=3e9, fresh_copy_bps=1e9, install_tensor_s=6e-4)
    got = move_time(move, parse_cluster("cpu:1x4"), model=terms, groups=1, group_b=1,
                    build=counts, state_tensors=99, state_calls=2, agree_bytes=50_000)
    by_hand = {}
    for c in counts.values():
        build = (c.mesh_calls * 0.002 + len(c.mesh_groups) * 0.03 + c.tensors * 5e-4
                 + c.tp_tensors * 2e-3 + c.fsdp_units * 3e-3 + c.fsdp_tensors * 1e-3
                 + c.tensors * 7e-4 + c.param_bytes / 2e9)
        install = c.param_bytes / 3e9 + 2 * c.param_bytes / 1e9 + c.tensors * 6e-4
        by_hand[c] = (build, install)
    assert tuple(got.parts) == PARTS
    assert got.parts["build"] == pytest.approx(max(b for b, _ in by_hand.values()), rel=1e-12)
    assert got.parts["install"] == pytest.approx(max(i for _, i in by_hand.values()), rel=1e-12)
    assert got.parts["extract"] == pytest.approx(99 * 1e-4 + 2 * 5e-3, rel=1e-12)
    assert got.parts["group"] == 0.0 and got.parts["group_b"] == pytest.approx(0.04)
    assert got.parts["plan"] == 0.02
    assert got.parts["agree"] == pytest.approx(0.01 + 0.003 + 50_000 * 1e-8, rel=1e-12)
    assert got.total_s == pytest.approx(sum(got.parts.values()), rel=1e-12)
    # a plan with TP ranks builds more than the same plan without
    assert max(b for b, _ in by_hand.values()) > 0.0


def test_plain_tensors_are_priced_at_the_plain_figures() -> None:
    model = catalog_model("gpt-tiny", seq_len=16)
    ddp = build_counts(model, plan_for(model, pp=2, dp=2, global_batch=8, num_microbatches=4))
    fsdp = build_counts(model, plan_for(model, dp=4, zero=3, global_batch=8,
                                        num_microbatches=2))
    terms = MoveTimeModel(materialize_tensor_s=1e-3, plain_materialize_tensor_s=2e-4,
                          state_tensor_s=3e-4, plain_state_tensor_s=5e-5)
    for c in ddp.values():  # DDP over a pipeline: no DTensor
        assert c.dtensors == 0
        assert terms.build_time_s(c) == pytest.approx(c.tensors * 2e-4, rel=1e-12)
        assert terms.extract_time_s(c) == pytest.approx(3 * c.tensors * 5e-5, rel=1e-12)
    for c in fsdp.values():  # FSDP2: every tensor a DTensor
        assert c.dtensors == c.tensors
        assert terms.build_time_s(c) == pytest.approx(c.tensors * 1e-3, rel=1e-12)
        assert terms.extract_time_s(c) == pytest.approx(3 * c.tensors * 3e-4, rel=1e-12)
