"""Layer strategies in Plan JSON, and the transition costs between neighbouring layers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshmorph.cost.model import CostModel
from meshmorph.cost.rank_terms import head_loss_bytes
from meshmorph.cost.transition import transition
from meshmorph.plan.strategy_dp import stage_choices
from meshmorph.schedule.table import Schedule
from meshmorph.spec.catalog import load_model
from meshmorph.spec.cluster import parse_cluster
from meshmorph.spec.model import Recompute
from meshmorph.spec.plan import LayerStrategy, Plan, PlanError

EXAMPLE = Path(__file__).parents[2] / "examples" / "plans" / "layerwise-gpt-small.json"


def _plan(strategies: list[LayerStrategy] | None) -> Plan:
    model = load_model("gpt-tiny")
    plan = Plan(model="gpt-tiny", seq_len=model.seq_len, global_batch=8, tp=1, dp=4, zero=0,
                micro_batch=2, num_microbatches=1).with_even_stages(model)
    stage = plan.stages[0]
    from dataclasses import replace
    return replace(plan, stages=(replace(stage, layer_strategies=None if strategies is None
                                         else tuple(strategies)),))


def test_json_round_trip_keeps_layer_strategies_exactly() -> None:
    mixed = [LayerStrategy(tp=2, dp=2, zero=0)] + [LayerStrategy(tp=1, dp=4, zero=3)] * 5
    plan = _plan(mixed)
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert again.stages[0].layer_strategies == tuple(mixed)
    assert json.loads(plan.to_json())["stages"][0]["layer_strategies"][0] == {
        "tp": 2, "dp": 2, "zero": 0}


def test_plan_without_layer_strategies_writes_no_key_and_round_trips() -> None:
    plan = _plan(None)
    data = json.loads(plan.to_json())
    assert "layer_strategies" not in data["stages"][0]
    assert Plan.from_json(plan.to_json()) == plan


def test_old_plan_files_load_unchanged() -> None:
    for path in sorted((Path(__file__).parents[2] / "examples").rglob("*.json")):
        data = json.loads(path.read_text())
        if "stages" not in data or "model" not in data:
            continue
        plan = Plan.from_dict(data)
        assert Plan.from_json(plan.to_json()) == plan, path


def test_layer_strategy_must_split_the_stage_devices() -> None:
    with pytest.raises(PlanError, match="tp 2 x dp 4 != the stage's 4 devices"):
        _plan([LayerStrategy(tp=2, dp=4)] * 6)
    with pytest.raises(PlanError, match="lists 2 layer strategies for 6 layers"):
        _plan([LayerStrategy(tp=1, dp=4)] * 2)


def test_transition_costs_match_hand_computed_all_gathers() -> None:
    model = load_model("llama2-7b", 2048)
    cost = CostModel(model, parse_cluster("a100-80g:1x8"))
    gpu = cost.default_gpu()
    link = cost.group_link(gpu, 8)
    alpha, beta = link.latency_s, link.bandwidth_bps
    a, b = LayerStrategy(tp=8, dp=1), LayerStrategy(tp=2, dp=4)
    # tp 8 -> 2: forward slices (free); backward gathers the gradient of all 8 sequences
    # (B / dp_a = 8 sequences x 2048 x 4096 x 2 bytes) over k = 4 ranks
    down = transition(cost, a, b, 8, "bf16", gpu)
    nbytes = 8 * 2048 * 4096 * 2
    assert (down.fwd_collective, down.bwd_collective, down.group_size) == ("slice", "all_gather", 4)
    assert down.gathered_bytes == nbytes
    assert down.fwd_s == 0.0
    assert down.bwd_s == pytest.approx(3 * alpha + 3 / 4 * nbytes / beta, rel=1e-12)
    # tp 2 -> 8: forward gathers (B / dp_b = 8 sequences), backward slices
    up = transition(cost, b, a, 8, "bf16", gpu)
    assert (up.fwd_collective, up.bwd_collective, up.bwd_s) == ("all_gather", "slice", 0.0)
    assert up.fwd_s == pytest.approx(down.bwd_s, rel=1e-12)
    # tp 1 -> 2 on a stage micro-batch of 8: dp 8 -> 4, each rank gathers 2 sequences over 2
    small = transition(cost, LayerStrategy(tp=1, dp=8), LayerStrategy(tp=2, dp=4), 8, "bf16", gpu)
    two = 2 * 2048 * 4096 * 2
    link2 = cost.group_link(gpu, 2)
    assert small.gathered_bytes == two
    assert small.fwd_s == pytest.approx(link2.latency_s + two / 2 / link2.bandwidth_bps, rel=1e-12)
    # ZeRO alone moves no activation
    same = transition(cost, LayerStrategy(tp=2, dp=4, zero=0), LayerStrategy(tp=2, dp=4, zero=3),
                      8, "bf16", gpu)
    assert (same.fwd_s, same.bwd_s, same.fwd_collective) == (0.0, 0.0, "none")


def test_transitions_add_to_the_step_of_a_mixed_plan() -> None:
    model = load_model("gpt-tiny")
    cost = CostModel(model, parse_cluster("a100-40g:1x4"))
    mixed = _plan([LayerStrategy(tp=2, dp=2)] + [LayerStrategy(tp=1, dp=4)] * 5)
    estimate = cost.estimate(mixed)
    step = transition(cost, LayerStrategy(tp=2, dp=2), LayerStrategy(tp=1, dp=4), 8, "bf16",
                      cost.default_gpu())
    assert estimate.breakdown_s["transitions"] == pytest.approx(step.fwd_s + step.bwd_s, rel=1e-12)
    assert step.bwd_s > 0 and step.fwd_s == 0.0


def test_committed_example_has_two_strategies_in_one_stage_and_estimates() -> None:
    plan = Plan.load(EXAMPLE)
    assert any(s.layer_strategies and len(set(s.layer_strategies)) >= 2 for s in plan.stages)
    model = load_model(plan.model, plan.seq_len)
    cost = CostModel(model, parse_cluster(f"a100-80g:1x{plan.world_size}"))
    estimate = cost.estimate(plan)
    assert estimate.fits
    assert estimate.step_time_s > 0
    assert all(mode in (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)
               for mode in plan.recompute_of_layer())


def test_plan_cli_layerwise_writes_uniform_best_beside_the_best_plan(tmp_path: Path) -> None:
    import contextlib
    import io

    from meshmorph.cli import main

    figures = {}
    for flag in ("--layerwise", "--uniform"):
        out = tmp_path / f"{flag[2:]}.json"
        with contextlib.redirect_stdout(io.StringIO()):
            code = main(["plan", "--model", "llama2-7b", "--seq-len", "2048", "--cluster",
                         "a100-80g:1x8", "--global-batch", "16", flag, "--json", str(out)])
        assert code == 0
        data = json.loads(out.read_text())
        figures[flag] = (data["plans"][0]["predicted"]["tokens_per_s"],
                         data["uniform_best_tokens_per_s"], data["layerwise_best_tokens_per_s"],
                         data["regular_best_tokens_per_s"])
        assert data["runnable"] and data["layerwise_schedules"] == "runnable"
        Plan.from_dict(data["plans"][0])  # loads back
    best, uniform, layerwise, regular = figures["--layerwise"]
    assert layerwise > uniform  # the embedding takes tp 2 while the blocks keep tp 1
    assert best == max(layerwise, regular)  # never worse than the regular planner
    assert figures["--uniform"][1:3] == (uniform, uniform)
    assert figures["--uniform"][0] == max(uniform, regular)


def test_layer_tp_that_does_not_divide_the_heads_is_refused() -> None:
    model = load_model("gpt-tiny")  # 4 heads
    plan = Plan(model="gpt-tiny", seq_len=model.seq_len, global_batch=16, tp=1, dp=8,
                micro_batch=2, num_microbatches=1).with_even_stages(model)
    from dataclasses import replace
    bad = replace(plan, stages=(replace(plan.stages[0], layer_strategies=(
        LayerStrategy(tp=8, dp=1),) + (LayerStrategy(tp=1, dp=8),) * 5),))
    with pytest.raises(PlanError, match="tp 8 does not divide num_heads 4 of gpt-tiny"):
        bad.check_against(model)


UNIFORM_CASES = [  # (model, pp, schedule, vpp, recompute): gpt ties its embedding and head
    ("gpt-small", 1, "1f1b", 1, Recompute.SELECTIVE),
    ("llama-tiny", 1, "1f1b", 1, Recompute.NONE),
    ("gpt-small", 2, "1f1b", 1, Recompute.SELECTIVE),
    ("gpt-small", 2, "gpipe", 1, Recompute.SELECTIVE),
    ("gpt-small", 2, "zb", 1, Recompute.NONE),
    ("gpt-small", 2, "interleaved", 3, Recompute.SELECTIVE),
    ("gpt-tiny", 2, "zbv", 2, Recompute.NONE),
    ("gpt-tiny", 2, "dualpipev", 2, Recompute.SELECTIVE),
    ("llama-tiny", 2, "1f1b", 1, Recompute.NONE),
    ("llama-tiny", 2, "gpipe", 1, Recompute.SELECTIVE),
    ("llama-tiny", 2, "zbv", 2, Recompute.NONE),
    ("llama-tiny", 2, "zbv", 2, Recompute.SELECTIVE),
    ("llama-tiny", 2, "dualpipev", 2, Recompute.NONE),
    ("llama-tiny", 2, "dualpipev", 2, Recompute.SELECTIVE),
]


@pytest.mark.parametrize(("name", "pp", "schedule", "vpp", "recompute"), UNIFORM_CASES)
def test_uniform_plan_without_data_parallel_prices_as_the_cost_model(
        name: str, pp: int, schedule: str, vpp: int, recompute: Recompute) -> None:
    """With dp = 1 nothing is exposed per layer rather than per chunk, so the layerwise model
    gives CostModel's step and every rank's memory to rounding: tied (gpt) and untied (llama)
    models, pp 1 and 2, one chunk per rank, interleaved (both chunks of a rank) and the V
    schedules (rank r holds chunks r and 2pp - 1 - r: a tied embedding and head are two
    parameters on rank 0 there). Both include the tied embedding's all-reduce between the end
    ranks and the head's loss buffers, and the case must have them where they apply."""
    from dataclasses import replace

    model = load_model(name)
    cost = CostModel(model, parse_cluster(f"a100-80g:1x{2 * pp}"))
    blocks = model.num_layers - 2
    plan = Plan(model=name, seq_len=model.seq_len, global_batch=4, tp=2, pp=pp, dp=1,
                micro_batch=1, num_microbatches=4, schedule=schedule, vpp=vpp
                ).with_even_stages(model, recompute)
    assert len(plan.stages) == pp * vpp and blocks % (pp * vpp) == 0
    listed = replace(plan, stages=tuple(replace(s, layer_strategies=(LayerStrategy(tp=2, dp=1),)
                                                * s.num_layers) for s in plan.stages))
    ours, theirs = cost.estimate(listed), cost.estimate(plan)
    gpu = cost.default_gpu()
    split = plan.pp_rank_of_chunk(0) != plan.pp_rank_of_chunk(plan.num_chunks - 1)
    syncs = [cost.tied_embedding_sync_s(plan, k, gpu) for k in range(pp)]
    assert (min(syncs) > 0) == (model.tied_embeddings and split)  # both end ranks pay it
    assert sum(head_loss_bytes(cost, plan, k) > 0 for k in range(pp)) == 1
    assert ours.step_time_s == pytest.approx(theirs.step_time_s, rel=1e-9)
    assert [m.total for m in ours.memory] == pytest.approx([m.total for m in theirs.memory],
                                                           rel=1e-9)


def test_the_terms_cache_tells_interleaved_vpp_apart() -> None:
    """Two interleaved configurations that differ only in vpp hold different micro-batches in
    flight, so one search's shared cache must not hand the second the first's layer terms."""
    model = load_model("llama2-7b", 2048)
    cost = CostModel(model, parse_cluster("a100-80g:1x8"))
    gpu = cost.default_gpu()
    strategies = [LayerStrategy(tp=2, dp=2, zero=0), LayerStrategy(tp=4, dp=1, zero=0)]
    modes = (Recompute.NONE, Recompute.FULL)
    cache: dict = {}
    rows = {}
    for vpp in (2, 4):
        plan = Plan(model=model.name, seq_len=2048, global_batch=16, tp=2, dp=2, pp=2,
                    micro_batch=2, num_microbatches=4, schedule=Schedule.INTERLEAVED,
                    vpp=vpp).with_even_stages(model)
        chunks = [(plan.stages[c].start, plan.stages[c].stop) for c in plan.chunks_of(0)]
        shared = stage_choices(cost, plan, 0, 0, 0, strategies, modes, gpu, cache, chunks)
        fresh = stage_choices(cost, plan, 0, 0, 0, strategies, modes, gpu, {}, chunks)
        assert shared == fresh
        rows[vpp] = fresh
    # the block rows differ between the two (in-flight micro-batches: 2.5 against 2.25), in
    # the bytes the layer adds to its rank, not in its time
    assert rows[2][1][0].memory_bytes != rows[4][1][0].memory_bytes
    assert rows[2][1][0].piece == rows[4][1][0].piece
