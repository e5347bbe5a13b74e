"""``meshmorph plan / estimate / models / gpus`` run in-process: exit codes, JSON, reports, charts."""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import replace
from pathlib import Path

import pytest

from meshmorph.cli import main
from meshmorph.cost.estimate import GIB
from meshmorph.cost.model import CostModel
from meshmorph.plan.report import memory_summary, recompute_summary
from meshmorph.spec.catalog import load_model
from meshmorph.spec.cluster import parse_cluster
from meshmorph.spec.model import Recompute
from meshmorph.spec.plan import Plan
from meshmorph.viz.timeline_chart import plan_timeline

EXAMPLE_PLAN = Path(__file__).resolve().parents[2] / "examples" / "plans" / "megatron-gpt3-175b.json"
REQUIRED_PLAN_KEYS = {"world_size", "tp", "pp", "dp", "zero", "micro_batch", "num_microbatches",
                      "schedule", "vpp", "stages", "predicted"}
REQUIRED_PREDICTED_KEYS = {"step_time_s", "tokens_per_s", "tflops_per_gpu", "mfu",
                           "peak_memory_gib", "bubble_fraction"}
GPT3_175B_FLAGS = ["--model", "gpt3-175b", "--cluster", "a100-80g:96x8", "--tp", "8", "--pp", "8",
                   "--dp", "12", "--global-batch", "1536", "--schedule", "interleaved", "--vpp",
                   "2", "--recompute", "full", "--compile"]  # the example plan says compile
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of ``meshmorph ARGV`` run in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 5000  # axes, bars and labels, not an empty canvas


@pytest.fixture(scope="module")
def gpt3_plan_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, Path, Path]:
    folder = tmp_path_factory.mktemp("plan")
    json_path, chart = folder / "plans.json", folder / "best.png"
    code, out, _ = run_cli(["plan", "--model", "gpt3-1.3b", "--cluster", "a100-80g:1x8",
                            "--global-batch", "64", "--seq-len", "2048", "--top", "3",
                            "--json", str(json_path), "--chart", str(chart)])
    return code, out, json_path, chart


def test_plan_gpt3_1p3b_on_8_a100_writes_three_plans_with_required_keys(gpt3_plan_run) -> None:
    code, out, json_path, _ = gpt3_plan_run
    assert code == 0
    data = json.loads(json_path.read_text())
    assert data["search_time_s"] > 0
    assert len(data["plans"]) == 3
    steps = [p["predicted"]["step_time_s"] for p in data["plans"]]
    assert steps == sorted(steps) and steps[0] > 0
    for plan in data["plans"]:
        assert set(plan) >= REQUIRED_PLAN_KEYS
        assert set(plan["predicted"]) >= REQUIRED_PREDICTED_KEYS
        assert plan["world_size"] == plan["tp"] * plan["pp"] * plan["dp"] == 8
        assert plan["dp"] * plan["micro_batch"] * plan["num_microbatches"] == 64
        assert len(plan["predicted"]["peak_memory_gib"]) == plan["pp"]
        assert max(plan["predicted"]["peak_memory_gib"]) <= 80.0
        assert len(plan["stages"]) == plan["pp"] * plan["vpp"]
        assert plan["stages"][0]["layers"][0] == 0 and plan["stages"][-1]["layers"][1] == 26
    assert "searched" in out and "optimality gap" in out and "gpt3-1.3b" in out


def test_plan_json_loads_back_and_its_prediction_matches_the_cost_model(gpt3_plan_run) -> None:
    _, _, json_path, _ = gpt3_plan_run
    data = json.loads(json_path.read_text())
    plan = Plan.load(json_path)
    assert plan == Plan.from_dict(data["plans"][0])
    assert plan.to_dict() == data["plans"][0]
    estimate = CostModel(load_model("gpt3-1.3b", 2048), parse_cluster("a100-80g:1x8")).estimate(plan)
    assert estimate.step_time_s == data["plans"][0]["predicted"]["step_time_s"]
    assert estimate.peak_memory_gib == data["plans"][0]["predicted"]["peak_memory_gib"]


def test_plan_chart_writes_timeline_and_memory_pngs(gpt3_plan_run) -> None:
    _, out, _, chart = gpt3_plan_run
    assert_png(chart)
    assert_png(chart.with_name("best-memory.png"))
    assert "best-memory.png" in out


def test_plan_llama_tiny_on_4_cpu_processes_prints_the_table(tmp_path: Path) -> None:
    json_path = tmp_path / "tiny.json"
    code, out, _ = run_cli(["plan", "--model", "llama-tiny", "--cluster", "cpu:1x4",
                            "--global-batch", "16", "--seq-len", "32", "--dtype", "fp32",
                            "--top", "4", "--json", str(json_path)])
    assert code == 0
    plans = json.loads(json_path.read_text())["plans"]
    assert len(plans) == 4
    assert all(p["world_size"] == 4 and p["dtype"] == "fp32" for p in plans)
    for column in ("tp pp dp", "ZeRO", "sched", "recomp", "tok/s", "MFU", "bubble"):
        assert column in out  # the short headers of a table fitted to 100 columns
    assert Plan.load(json_path).world_size == 4


def test_estimate_gpt3_175b_interleaved_prints_breakdown_and_json(tmp_path: Path) -> None:
    json_path = tmp_path / "estimate.json"
    code, out, err = run_cli(["estimate", *GPT3_175B_FLAGS, "--json", str(json_path)])
    assert (code, err) == (0, "")
    data = json.loads(json_path.read_text())
    assert (data["tp"], data["pp"], data["dp"], data["vpp"]) == (8, 8, 12, 2)
    assert (data["world_size"], data["num_microbatches"], data["schedule"]) == (768, 128, "interleaved")
    assert len(data["stages"]) == 16
    recompute = [mode for stage in data["stages"] for mode in stage["recompute"]]
    assert recompute.count("full") == 96 and len(recompute) == 98
    predicted = data["predicted"]
    assert predicted["fits"] is True
    assert len(predicted["peak_memory_gib"]) == 8
    assert sum(predicted["breakdown_s"].values()) == pytest.approx(predicted["step_time_s"], rel=1e-9)
    model, cluster = load_model("gpt3-175b", 2048), parse_cluster("a100-80g:96x8")
    expected = CostModel(model, cluster).estimate(Plan.load(json_path))
    assert predicted["step_time_s"] == expected.step_time_s
    assert f"{expected.step_time_s:.4f}" in out  # the step row of the breakdown
    for term in ("compute", "recompute", "tp comm", "pp bubble", "dp comm exposed", "optimizer",
                 "activ", "optim", "free", "fits"):  # short headers at 100 columns
        assert term in out
    assert "full 96/96" in out


def test_estimate_from_the_example_plan_file_matches_the_flags(tmp_path: Path) -> None:
    by_flags, by_file = tmp_path / "flags.json", tmp_path / "file.json"
    assert run_cli(["estimate", *GPT3_175B_FLAGS, "--json", str(by_flags)])[0] == 0
    code, _, _ = run_cli(["estimate", "--plan", str(EXAMPLE_PLAN), "--cluster", "a100-80g:96x8",
                          "--json", str(by_file)])
    assert code == 0
    flags, file = json.loads(by_flags.read_text()), json.loads(by_file.read_text())
    assert file == flags


def test_estimate_that_does_not_fit_names_the_stage_and_exits_1() -> None:
    argv = ["--model", "gpt3-175b", "--cluster", "a100-80g:96x8", "--tp", "8", "--pp", "8",
            "--dp", "12", "--global-batch", "1536", "--micro-batch", "4", "--zero", "1"]
    code, out, _ = run_cli(["estimate", *argv])
    assert code == 1
    plan = Plan(model="gpt3-175b", seq_len=2048, global_batch=1536, tp=8, pp=8, dp=12, zero=1,
                micro_batch=4, num_microbatches=32)
    model = load_model("gpt3-175b")
    estimate = CostModel(model, parse_cluster("a100-80g:96x8")).estimate(
        plan.with_even_stages(model, Recompute.NONE))
    need = estimate.memory[0].total / GIB
    assert need > 80
    line = " ".join(out.split())  # undo the console's line wrapping
    assert f"DOES NOT FIT: stage 0 needs {need:.1f} GiB per GPU, the device has 80.0 GiB" in line
    assert "--recompute full" in line and "--zero 3" in line


def test_estimate_with_degrees_not_matching_the_cluster_exits_2_naming_both() -> None:
    code, out, err = run_cli(["estimate", "--model", "gpt3-175b", "--cluster", "a100-80g:96x8",
                              "--tp", "8", "--pp", "8", "--dp", "8", "--global-batch", "1536"])
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("meshmorph: error:")
    assert "= 512 ranks" in err and "has 768" in err


@pytest.mark.parametrize(("argv", "message"), [
    (["estimate", "--model", "gpt3-175b", "--cluster", "a100-80g:96x8", "--tp", "8", "--pp", "8",
      "--dp", "12", "--global-batch", "1537"], "global batch 1537 is not divisible by dp 12"),
    (["estimate", "--model", "gpt-9000", "--cluster", "cpu:1x2", "--tp", "1", "--pp", "1",
      "--dp", "2"], "unknown model 'gpt-9000'"),
    (["plan", "--model", "gpt3-1.3b", "--cluster", "a100:1x8", "--global-batch", "8"],
     "unknown GPU 'a100'"),
    (["plan", "--model", "gpt3-1.3b", "--cluster", "a100-80g:8", "--global-batch", "8"],
     "cannot read cluster 'a100-80g:8'"),
    (["plan", "--model", "gpt3-6.7b", "--cluster", "v100-16g:1x2", "--global-batch", "8"],
     "no plan fits memory"),
    (["estimate", "--model", "gpt-tiny", "--cluster", "cpu:1x2", "--tp", "1"],
     "estimate needs --pp, --dp"),
    (["estimate", "--plan", str(EXAMPLE_PLAN), "--cluster", "a100-80g:96x8", "--tp", "8"],
     "give either --plan or --tp"),
    (["plan", "--model", "gpt-tiny", "--cluster", "cpu:1x2", "--global-batch", "8",
      "--max-nodes", "-5"], "must be 0 (no limit) or a positive count, got -5"),
])
def test_user_errors_are_one_line_with_exit_2(argv: list[str], message: str) -> None:
    code, _, err = run_cli(argv)
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err
    assert message in err


def test_models_lists_the_catalog_with_shapes_and_parameters(tmp_path: Path) -> None:
    json_path = tmp_path / "models.json"
    code, out, _ = run_cli(["models", "--json", str(json_path)])
    assert code == 0
    rows = {r["name"]: r for r in json.loads(json_path.read_text())["models"]}
    assert {"gpt3-1.3b", "gpt3-175b", "llama2-70b", "llama3-8b", "llama-tiny"} <= set(rows)
    gpt3 = rows["gpt3-175b"]
    assert (gpt3["layers"], gpt3["hidden"], gpt3["heads"], gpt3["vocab"]) == (96, 12288, 96, 50257)
    assert 174.0 < gpt3["params_b"] < 176.0
    llama = rows["llama3-8b"]
    assert (llama["heads"], llama["kv_heads"], llama["ffn"], llama["seq_len"]) == (32, 8, 14336, 8192)
    assert "gpt3-175b" in out and "32/8" in out


def test_gpus_lists_dense_peaks_memory_and_links(tmp_path: Path) -> None:
    json_path = tmp_path / "gpus.json"
    code, out, _ = run_cli(["gpus", "--json", str(json_path)])
    assert code == 0
    rows = {r["name"]: r for r in json.loads(json_path.read_text())["gpus"]}
    assert {"a100-80g", "h100", "mi300x", "cpu"} <= set(rows)
    a100, h100 = rows["a100-80g"], rows["h100"]
    assert (a100["memory_gib"], a100["hbm_gbps"], a100["peak_tflops"]["bf16"]) == (80, 2039, 312.0)
    assert (h100["peak_tflops"]["bf16"], h100["peak_tflops"]["fp8"]) == (989.4, 1978.9)
    assert h100["intra_node_link"] == "nvlink4"
    assert "989.4" in out and "nvlink3 / ib-hdr" in out


def test_zero_bubble_timeline_holds_f_b_and_w_for_every_micro_batch(tmp_path: Path) -> None:
    chart = tmp_path / "zb.png"
    code, out, _ = run_cli(["estimate", "--model", "gpt3-1.3b", "--cluster", "a100-80g:1x8",
                            "--tp", "1", "--pp", "4", "--dp", "2", "--global-batch", "16",
                            "--schedule", "zb", "--chart", str(chart)])
    assert code == 0
    assert_png(chart)
    assert_png(tmp_path / "zb-memory.png")
    model, cluster = load_model("gpt3-1.3b"), parse_cluster("a100-80g:1x8")
    plan = Plan(model="gpt3-1.3b", seq_len=2048, global_batch=16, pp=4, dp=2,
                num_microbatches=8, schedule="zb").with_even_stages(model)
    timeline = plan_timeline(plan, CostModel(model, cluster))
    for rank in range(4):
        kinds = [op[1] for op in timeline.ops if op[0] == rank]
        assert (kinds.count("F"), kinds.count("I"), kinds.count("W")) == (8, 8, 8)  # I: input grad
    estimate = CostModel(model, cluster).estimate(plan)
    assert timeline.bubble_fraction == estimate.bubble_fraction


def test_recompute_summary_counts_blocks_only_when_the_model_is_given() -> None:
    model = load_model("llama-tiny")  # embedding + 4 blocks + head
    plan = Plan(model="llama-tiny", seq_len=32, global_batch=2, pp=2,
                num_microbatches=2).with_even_stages(model, Recompute.FULL)
    stages = (replace(plan.stages[0], recompute=(Recompute.NONE, Recompute.SELECTIVE,
                                                 Recompute.NONE)), plan.stages[1])
    mixed = replace(plan, stages=stages)
    assert recompute_summary(plan, model) == "full 4/4"
    assert recompute_summary(mixed, model) == "full 2/4, sel 1/4"
    assert recompute_summary(mixed) == "full 2/6, sel 1/6"
    assert recompute_summary(plan.with_even_stages(model)) == "none"


def test_memory_summary_lists_up_to_three_stages_then_a_range() -> None:
    assert memory_summary([52.25]) == "52.2"
    assert memory_summary([1.0, 2.5, 3.0]) == "1.0 / 2.5 / 3.0"
    assert memory_summary([4.0, 1.26, 5.0, 2.0]) == "1.3–5.0"


def test_the_no_fit_message_offers_only_ways_out_the_search_has_not_tried() -> None:
    from meshmorph.plan.search import PlanDoesNotFit, search
    from meshmorph.plan.space import SearchOptions

    model, cluster = load_model("llama3-70b"), parse_cluster("a100-40g:1x8")
    with pytest.raises(PlanDoesNotFit) as searched:
        search(model, cluster, global_batch=64)  # ZeRO-3 and full recompute both tried
    text = str(searched.value)
    assert "zero 3" in text and "full recompute" in text
    assert "allow ZeRO-3" not in text and "allow full recompute" not in text
    with pytest.raises(PlanDoesNotFit) as narrow:
        search(model, cluster, global_batch=64, options=SearchOptions(
            zero_stages=(0, 1), recompute=(Recompute.NONE, Recompute.SELECTIVE)))
    assert "allow ZeRO-3" in str(narrow.value) and "allow full recompute" in str(narrow.value)
