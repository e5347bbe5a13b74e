"""Context parallelism (cp): the Plan field, its pricing by hand, the planner at 128K tokens, and
the runtime's refusal."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshmorph.cost import comm
from meshmorph.cost.context_parallel import kv_bytes, ring_step_flops, ring_time
from meshmorph.cost.model import CostModel
from meshmorph.cost.rank_state import predict_rank_state
from meshmorph.cost.rank_terms import head_loss_bytes, ring_buffer_bytes
from meshmorph.elastic.moves.layout import layout_of
from meshmorph.plan.search import search
from meshmorph.plan.space import SearchOptions, configurations
from meshmorph.spec.catalog import catalog_model
from meshmorph.spec.cluster import parse_cluster
from meshmorph.spec.model import LayerKind, Recompute
from meshmorph.spec.plan import Plan, PlanError
from meshmorph.spec.runnable import refuse_context_parallel
from meshmorph.spec.transformer import TransformerShape, build_transformer
from tests.helpers.jobs import gpt_tiny_job

SEQ = 32_768
MODEL = build_transformer(TransformerShape(name="cp-llama", arch="llama", num_layers=2,
                                           hidden_size=512, num_heads=8, num_kv_heads=2,
                                           vocab_size=1024, seq_len=SEQ))
BLOCK = next(i for i, layer in enumerate(MODEL.layers) if layer.kind == LayerKind.BLOCK)


def _plan(**changes: object) -> Plan:
    base = Plan(model=MODEL.name, seq_len=SEQ, global_batch=2, dp=2)
    return replace(base, **changes).with_even_stages(MODEL)


# --- the Plan field ---------------------------------------------------------------------------
def test_world_size_rank_order_and_json_without_cp() -> None:
    plan = Plan(model="m", seq_len=64, global_batch=4, tp=2, cp=4, dp=2, pp=2,
                num_microbatches=2)
    assert plan.world_size == 2 * 4 * 2 * 2
    # tp innermost, then cp, then dp, then pp (Megatron-Core's order)
    assert plan.rank_of(pp_rank=1, dp_rank=1, tp_rank=1, cp_rank=2) == ((1 * 2 + 1) * 4 + 2) * 2 + 1
    assert [plan.coords_of(r) for r in (0, 1, 2, 8, 16)] == [
        (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 1, 0, 0), (1, 0, 0, 0)]
    assert all(plan.rank_of(p, d, t, c) == r
               for r in range(plan.world_size) for p, d, c, t in [plan.coords_of(r)])
    data = Plan(model="m", seq_len=64, global_batch=2, dp=2).to_dict()
    del data["cp"]
    data["world_size"] = 2
    assert Plan.from_dict(data).cp == 1
    assert Plan.from_dict(plan.to_dict()) == plan


@pytest.mark.parametrize("cp, match", [(0, "cp must be at least 1"),
                                       (3, r"2 x cp = 6 equal chunks"),
                                       (32, r"2 x cp = 64 equal chunks")])
def test_bad_cp_is_refused_naming_the_constraint(cp: int, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        Plan(model="m", seq_len=1000 if cp != 32 else 32, global_batch=1, cp=cp)


def test_sequence_parallel_needs_tp_to_divide_each_ranks_tokens() -> None:
    model = build_transformer(TransformerShape(name="cp-sp", arch="llama", num_layers=1,
                                               hidden_size=256, num_heads=4, num_kv_heads=4,
                                               vocab_size=512, seq_len=48))
    plan = Plan(model=model.name, seq_len=48, global_batch=1, tp=4, cp=8,
                sequence_parallel=True).with_even_stages(model)  # 48 / 8 = 6 tokens, tp 4
    with pytest.raises(PlanError, match="divide the 6 tokens each of cp 8 ranks holds"):
        plan.check_against(model)
    replace(plan, cp=4).check_against(model)  # 12 tokens: tp 4 divides them


# --- pricing by hand --------------------------------------------------------------------------
def test_cp_1_prices_as_a_plan_that_never_names_cp() -> None:
    cost = CostModel(MODEL, parse_cluster("h100:1x8"))
    named = cost.estimate(_plan(cp=1))
    data = _plan().to_dict()
    del data["cp"]
    unnamed = cost.estimate(Plan.from_dict(data))
    assert named.to_dict() == unnamed.to_dict()
    assert "cp_comm_exposed" not in named.breakdown_s
    # the layer coster for cp 1 is the one built before cp existed (no ring, full tokens)
    legacy = cost.layer_coster("bf16")
    gpu = cost.default_gpu()
    assert cost.layer_coster("bf16", cp=1) is legacy
    assert legacy.layer(BLOCK, gpu, 1, 1, False, Recompute.NONE).cp_comm_s == 0.0


def test_cp_2_halves_activation_bytes_and_flops() -> None:
    cost = CostModel(MODEL, parse_cluster("h100:1x8"))
    gpu = cost.default_gpu()
    for index in range(MODEL.num_layers):
        one = cost.layer_coster("bf16", cp=1).layer(index, gpu, 1, 1, False, Recompute.NONE)
        two = cost.layer_coster("bf16", cp=2).layer(index, gpu, 1, 1, False, Recompute.NONE)
        assert two.activation_bytes == one.activation_bytes / 2
        assert two.flops == one.flops / 2
    one = cost.estimate(_plan(cp=1, dp=2))
    two = cost.estimate(_plan(cp=2, dp=1, global_batch=1))
    assert two.memory[0].activations == pytest.approx(one.memory[0].activations / 2,
                                                      rel=1e-12)
    # the ring's receive buffers (next K/V and their gradients) sit with the rank's fixed bytes,
    # as the head's loss buffers (which cp halves too) do
    buffers = 2 * kv_bytes(MODEL, 1, 1, 2, 2.0)
    plan_one, plan_two = _plan(cp=1, dp=2), _plan(cp=2, dp=1, global_batch=1)
    fixed_one = one.memory[0].reserved - head_loss_bytes(cost, plan_one, 0)
    fixed_two = two.memory[0].reserved - head_loss_bytes(cost, plan_two, 0)
    assert head_loss_bytes(cost, plan_two, 0) == head_loss_bytes(cost, plan_one, 0) / 2
    assert ring_buffer_bytes(cost, plan_two) == buffers
    assert fixed_two - fixed_one == pytest.approx(buffers, rel=1e-9)


def test_the_ring_by_hand_on_a_slow_link() -> None:
    """cp 2, tp 1, bf16, one sequence of 32768 tokens: each rank holds 16384 tokens; a block's K
    and V are 2 x 16384 x (2 kv heads x 64) x 2 bytes; one step (cp - 1 = 1) sends them forward and
    twice that backward; exposed = transfer - the step's causal attention block."""
    link = comm.Link(latency_s=1e-5, bandwidth_bps=1e9)
    nbytes = 2 * 16_384 * 128 * 2
    assert kv_bytes(MODEL, 1, 1, 2, 2.0) == nbytes
    flops = 2.0 * 16_384 * 16_384 * 512  # QK^T and AV over half of a 16384 x 16384 block
    assert ring_step_flops(MODEL, 1, 1, 2) == flops
    rate = 1e15
    ring = ring_time(MODEL, micro_batch=1, tp=1, cp=2, element_bytes=2.0, flops_per_s=rate,
                     link=link)
    fwd = 1e-5 + nbytes / 1e9
    bwd = 1e-5 + 2 * nbytes / 1e9
    assert ring.fwd_transfer_s == pytest.approx(fwd)
    assert ring.fwd_exposed_s == pytest.approx(fwd - flops / rate)
    assert ring.bwd_exposed_s == pytest.approx(bwd - 2 * flops / rate)
    # a fast enough kernel hides all of it; cp 1 has no ring
    assert ring_time(MODEL, micro_batch=1, tp=1, cp=2, element_bytes=2.0, flops_per_s=1e12,
                     link=link).fwd_exposed_s == 0.0
    assert ring_time(MODEL, micro_batch=1, tp=1, cp=1, element_bytes=2.0, flops_per_s=rate,
                     link=link).fwd_transfer_s == 0.0


def test_the_ring_crosses_nodes_once_tp_x_cp_leaves_one() -> None:
    cost = CostModel(MODEL, parse_cluster("h100:2x4"))
    gpu = cost.default_gpu()
    assert cost.layer_coster("bf16", cp=4).cp_link(gpu.name, 1) == cost.intra[gpu.name]
    assert cost.layer_coster("bf16", cp=4).cp_link(gpu.name, 2) == cost.inter
    slow = cost.layer_coster("bf16", cp=4).layer(BLOCK, gpu, 1, 2, False, Recompute.NONE)
    fast = cost.layer_coster("bf16", cp=4).layer(BLOCK, gpu, 1, 1, False, Recompute.NONE)
    assert slow.cp_comm_s >= 0.0 and fast.cp_comm_s >= 0.0


def test_rank_state_sends_the_ring_and_shards_over_dp_x_cp() -> None:
    plan = _plan(cp=2, dp=1, global_batch=1, zero=3)
    one = _plan(cp=1, dp=2, global_batch=2, zero=3)
    with_cp = predict_rank_state(MODEL, plan, 1)
    with_dp = predict_rank_state(MODEL, one, 1)
    # ZeRO-3 over dp x cp = 2 either way: the same shard of the same parameters
    assert with_cp["params_bytes"] == with_dp["params_bytes"]
    blocks = MODEL.num_blocks
    ring = 1 * (2 - 1) * 3 * kv_bytes(MODEL, 1, 1, 2, 2.0) * blocks  # K/V fwd, K/V + grads bwd
    assert with_cp["comm_bytes"]["send_recv"] == pytest.approx(ring)


def test_a_plan_that_does_not_fit_at_cp_1_fits_at_cp_4() -> None:
    model = catalog_model("llama3-8b", seq_len=131_072)
    cost = CostModel(model, parse_cluster("h100:8x8"))
    base = Plan(model=model.name, seq_len=131_072, global_batch=8, tp=8, dp=8, zero=3,
                sequence_parallel=True).with_even_stages(model)
    assert not cost.estimate(base).fits
    four = replace(base, dp=2, cp=4, num_microbatches=4)
    estimate = cost.estimate(four)
    assert estimate.fits
    assert estimate.breakdown_s["cp_comm_exposed"] >= 0.0


# --- the planner ------------------------------------------------------------------------------
def test_the_planner_picks_cp_for_128k_tokens_of_llama3_8b_on_64_h100s() -> None:
    model = catalog_model("llama3-8b", seq_len=131_072)
    result = search(model, parse_cluster("h100:8x8"), global_batch=16,
                    options=SearchOptions(top_k=1))
    best, estimate = result.plans[0], result.estimates[0]
    assert best.cp > 1 and estimate.fits
    assert best.world_size == 64
    assert all(m.total <= b for m, b in zip(estimate.memory, estimate.memory_budget_bytes,
                                            strict=True))


def test_cp_is_searched_only_for_long_sequences_and_within_cp_max() -> None:
    short = catalog_model("llama3-8b", seq_len=8192)
    long = catalog_model("llama3-8b", seq_len=131_072)
    cluster = parse_cluster("h100:2x8")
    options = SearchOptions(zero_stages=(3,), schedules=(), max_micro_batch=1)
    assert {c.plan.cp for c in configurations(short, cluster, 16, options)} == {1}
    assert {c.plan.cp for c in configurations(long, cluster, 16, options)} == {1, 2, 4, 8, 16}
    capped = replace(options, cp_max=4)
    assert {c.plan.cp for c in configurations(long, cluster, 16, capped)} == {1, 2, 4}


# --- the runtime ------------------------------------------------------------------------------
def test_the_runtime_refuses_cp_before_launching() -> None:
    plan = _plan(cp=2, dp=1, global_batch=1)
    with pytest.raises(PlanError, match=r"cp 2 .*--max-cp 1"):
        refuse_context_parallel(plan)
    with pytest.raises(PlanError, match="elastic layouts and reshapes does not run context"):
        layout_of(MODEL, plan)
    refuse_context_parallel(_plan())  # cp 1 passes


def test_meshmorph_run_refuses_a_cp_plan_before_any_process_starts(
        tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from pathlib import Path

    from meshmorph.cli import main as cli_main

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a process was started for a cp plan")

    monkeypatch.setattr("subprocess.Popen", refuse)
    folder = Path(str(tmp_path))
    job = folder / "job.toml"
    job.write_text(gpt_tiny_job(steps=2))
    plan = Plan(model="gpt-tiny", seq_len=32, global_batch=8, cp=2, micro_batch=2,
                num_microbatches=4)
    (folder / "plan.json").write_text(plan.to_json())
    code = cli_main(["run", "--config", str(job), "--plan", str(folder / "plan.json"),
                     "--out", str(folder / "out")])
    assert code == 2
    assert "does not run context parallelism: the plan has cp 2" in capsys.readouterr().err


def test_the_tied_embedding_sync_and_fit_advice_count_dp_x_cp() -> None:
    gpt = build_transformer(TransformerShape(name="cp-gpt", arch="gpt", num_layers=4,
                                             hidden_size=256, num_heads=4, vocab_size=1024,
                                             seq_len=SEQ))
    cost = CostModel(gpt, parse_cluster("h100:1x8"))
    gpu = cost.default_gpu()
    plans = [Plan(model=gpt.name, seq_len=SEQ, global_batch=g, dp=d, cp=c, pp=2, zero=2,
                  num_microbatches=2).with_even_stages(gpt) for g, d, c in ((4, 2, 1), (2, 1, 2))]
    # FSDP2 shards the tied gradient over dp x cp = 2 in both plans: the same all-reduce
    assert cost.tied_embedding_sync_s(plans[0], 0, gpu) == cost.tied_embedding_sync_s(plans[1], 0, gpu)
    from meshmorph.plan.report import fit_advice

    assert "--cp 2 with --dp 1" in fit_advice(plans[0])


@pytest.mark.timeout(240)
def test_exact_planner_equals_the_independent_brute_force_with_cp_searched() -> None:
    """The independent brute force of test_planner_exact_independent.py (its own enumeration of
    cp: powers of two dividing the ranks of a tp group, 2 cp dividing the sequence) against the
    planner, on its random instances with cp searched at every sequence length."""
    import random

    from tests.unit import test_planner_exact_independent as independent

    rng = random.Random(20_251_124)
    compared = with_cp = 0
    while compared < 40:
        case = independent.random_case(rng)
        case = replace(case, options=replace(case.options, cp_min_seq_len=0))
        if independent.count_plans(case) > independent.MAX_PLANS:
            continue
        brute, _ = independent.brute_force_step(case)
        found = independent.planner_best(case)
        assert (found is None) == (brute is None), case
        if found is not None:
            assert found[1] == pytest.approx(brute, rel=1e-9), case
            with_cp += found[0].cp > 1
        compared += 1
    print(f"{compared} instances, {with_cp} best with cp > 1")
    assert with_cp >= 3, with_cp  # the draw really exercises cp
