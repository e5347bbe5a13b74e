"""Bad input through the real command line: job, plan, cluster and model files that are empty,
binary, of wrong types, with unknown keys, NaN, infinite or negative values; absurd arguments;
unwritable outputs. Each must end with exit code 2, one message that names the problem and a way
out, no traceback, and no process started."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshmorph.cli import main as cli_main
from tests.helpers.bad_input import forbid_processes, refused
from tests.helpers.jobs import gpt_tiny_job

JOB = gpt_tiny_job(steps=4, optim={"lr": 1e-3, "grad_clip": 1.0})
PLAN = {"model": "gpt-tiny", "seq_len": 32, "global_batch": 8, "dp": 2, "micro_batch": 2,
        "num_microbatches": 2, "dtype": "fp32"}
CLUSTER = """
[[groups]]
gpu = "h100"
nodes = 2
gpus_per_node = 8
"""
HF_GPT = {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 256, "n_positions": 32}
BINARY = bytes(range(256)) * 4


@pytest.fixture(autouse=True)
def _no_process_may_start(monkeypatch: pytest.MonkeyPatch) -> None:
    forbid_processes(monkeypatch)


def _write(path: Path, content: str | bytes) -> Path:
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


# --- job files ---------------------------------------------------------------------------------
JOB_CASES = [
    ("empty", "", ["missing section [model]"]),
    ("binary", BINARY, ["not valid TOML", "examples/jobs/"]),
    ("not toml", "[model\nsource=", ["not valid TOML"]),
    ("unknown section", JOB + "[extra]\nx = 1\n", ["unknown section [extra]", "known sections"]),
    ("unknown key", JOB.replace("steps = 4", "steps = 4\nepochs = 2"),
     ["unknown key 'epochs' in [train]", "known keys"]),
    ("wrong type", JOB.replace("steps = 4", 'steps = "four"'), ["[train] steps must be int"]),
    ("table not value", JOB.replace('kind = "synthetic"', "kind = 3"), ["[data] kind must be str"]),
    ("negative steps", JOB.replace("steps = 4", "steps = -4"),
     ["[train] steps must be at least 1, got -4"]),
    ("lr inf", JOB.replace("lr = 0.001", "lr = inf"), ["[optim] lr must be a finite number, got inf"]),
    ("lr nan", JOB.replace("lr = 0.001", "lr = nan"), ["[optim] lr must be a finite number, got nan"]),
    ("negative lr", JOB.replace("lr = 0.001", "lr = -1e-3"), ["[optim] needs 0 <= min_lr <= lr"]),
    ("grad_clip -1", JOB.replace("grad_clip = 1.0", "grad_clip = -1"),
     ["[optim] grad_clip must be >= 0 (0 disables clipping), got -1.0"]),
    ("beta2 1.5", JOB.replace("grad_clip = 1.0", "beta2 = 1.5"),
     ["[optim] beta2 must lie in [0, 1), got 1.5"]),
    ("micro-batch", JOB.replace("micro_batch = 2", "micro_batch = 3"),
     ["[train] micro_batch 3 does not divide global_batch 8"]),
    ("missing data", JOB.replace('kind = "synthetic"', 'kind = "text"\npath = "gone.txt"'),
     ["gone.txt does not exist", "fix [data] path"]),
    ("timeout 0", JOB + "[run]\ncollective_timeout_s = 0\n",
     ["[run] collective_timeout_s must be a positive number of seconds, got 0.0"]),
    ("unknown model", JOB.replace('source = "gpt-tiny"', 'source = "gpt-9000"'),
     ["unknown model 'gpt-9000'", "known models"]),
    ("seq_len 0", JOB.replace("seq_len = 32", "seq_len = 0"), ["[model] seq_len must be at least 1"]),
    ("compile not bool", JOB.replace("micro_batch = 2", 'micro_batch = 2\ncompile = "yes"'),
     ["[train] compile must be bool, got 'yes'"]),
    ("unknown compile backend", JOB.replace("micro_batch = 2",
                                            'micro_batch = 2\ncompile_backend = "tensorrt"'),
     ["[train] compile_backend must be inductor, aot_eager or eager, got 'tensorrt'"]),
]


@pytest.mark.parametrize(("content", "needles"), [case[1:] for case in JOB_CASES],
                         ids=[case[0] for case in JOB_CASES])
def test_bad_job_file_is_refused_naming_file_and_key(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                     content: str | bytes, needles: list[str]) -> None:
    job = _write(tmp_path / "job.toml", content)
    refused(capsys, ["run", "--config", str(job), "--out", str(tmp_path / "out")], *needles)
    assert not (tmp_path / "out").exists()


def test_missing_job_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    refused(capsys, ["run", "--config", str(tmp_path / "absent.toml")],
            f"job file {tmp_path / 'absent.toml'} does not exist", "examples/jobs/")


@pytest.mark.parametrize(("args", "needle"), [
    (["--nproc", "0"], "--nproc must be at least 1, got 0"),
    (["--nproc", "-2"], "--nproc must be at least 1, got -2"),
    (["--reshard"], "--reshard loads a checkpoint into another plan, so it needs --resume"),
])
def test_bad_run_arguments_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture,
                                       args: list[str], needle: str) -> None:
    job = _write(tmp_path / "job.toml", JOB)
    refused(capsys, ["run", "--config", str(job), "--out", str(tmp_path / "out"), *args], needle)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("args", "needles"), [
    (["--plan", "auto"], ["dtype fp8", "--plan auto searches plans for the local CPU processes",
                          "leave --plan out"]),
    (["--elastic", "1:1"], ["dtype fp8", "an --elastic run, after a membership change",
                            "run without --elastic"]),
])
def test_fp8_jobs_are_refused_the_searches_on_cpu(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                 args: list[str], needles: list[str]) -> None:
    job = _write(tmp_path / "job.toml", JOB.replace("steps = 4", 'steps = 4\ndtype = "fp8"'))
    refused(capsys, ["run", "--config", str(job), "--nproc", "2", "--out",
                     str(tmp_path / "out"), *args], *needles)
    assert not (tmp_path / "out").exists()


# --- plan files --------------------------------------------------------------------------------
PLAN_CASES = [
    ("empty", "", ["is empty", "meshmorph plan --json"]),
    ("binary", BINARY, ["is not text (binary data)"]),
    ("malformed", '{"model": "gpt-tiny", "dp": ', ["is not valid JSON", "meshmorph plan --json"]),
    ("a list", "[1, 2]", ["must hold a JSON object, got list"]),
    ("wrong type", json.dumps({**PLAN, "dp": "two"}), ["dp must be an integer, got 'two'"]),
    ("float degree", json.dumps({**PLAN, "dp": 2.5}), ["dp must be an integer, got 2.5"]),
    ("unknown key", json.dumps({**PLAN, "fsdp": True}), ["plan has unknown keys: fsdp"]),
    ("negative dp", json.dumps({**PLAN, "dp": -2}), ["dp must be at least 1, got -2"]),
    ("nan batch", json.dumps({**PLAN, "global_batch": float("nan")}),
     ["global_batch must be an integer, got nan"]),
    ("bool degree", json.dumps({**PLAN, "dp": True}), ["dp must be an integer, got True"]),
    ("unknown dtype", json.dumps({**PLAN, "dtype": "fp4"}),
     ["dtype must be one of bf16, fp16, fp32, fp8, got 'fp4'"]),
    ("fp8 recipe on fp32", json.dumps({**PLAN, "fp8_scaling": "rowwise"}),
     ["fp8_scaling 'rowwise' applies to dtype fp8, not 'fp32'", "set dtype fp8"]),
    ("missing keys", json.dumps({"model": "gpt-tiny"}), ["does not hold a valid plan", "seq_len"]),
    ("no plans", json.dumps({"plans": []}), ["lists no plans"]),
    ("bad stages", json.dumps({**PLAN, "stages": [{"layers": [0]}]}), ["does not hold a valid plan"]),
    ("world size", json.dumps({**PLAN, "dp": 4, "num_microbatches": 1}),
     ["tp 1 x pp 1 x dp 4 = 4 ranks, but the job has 2", "change a degree or the number"]),
]


@pytest.mark.parametrize(("content", "needles"), [case[1:] for case in PLAN_CASES],
                         ids=[case[0] for case in PLAN_CASES])
def test_bad_plan_file_is_refused_by_run(tmp_path: Path, capsys: pytest.CaptureFixture,
                                         content: str | bytes, needles: list[str]) -> None:
    job = _write(tmp_path / "job.toml", JOB)
    plan = _write(tmp_path / "plan.json", content)
    before = plan.read_bytes()
    refused(capsys, ["run", "--config", str(job), "--nproc", "2", "--plan", str(plan),
                     "--out", str(tmp_path / "out")], *needles)
    assert plan.read_bytes() == before and not (tmp_path / "out").exists()


def test_malformed_plan_file_is_refused_by_estimate(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture) -> None:
    plan = _write(tmp_path / "plan.json", "{not json")
    refused(capsys, ["estimate", "--cluster", "h100:1x8", "--plan", str(plan)],
            f"plan file {plan} is not valid JSON")


def test_missing_plan_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    refused(capsys, ["estimate", "--cluster", "h100:1x8", "--plan", str(tmp_path / "gone.json")],
            f"plan file {tmp_path / 'gone.json'} does not exist")


# --- cluster files -----------------------------------------------------------------------------
CLUSTER_CASES = [
    ("empty", "", ["needs at least one [[groups]] table"]),
    ("binary", BINARY, ["is not valid TOML", "h100:4x8"]),
    ("infinite latency", CLUSTER + "intra_node_latency_us = inf\n",
     ["intra_node_latency_us in [[groups]] #1 must be a number >= 0, got inf"]),
    ("nan bandwidth", CLUSTER + "intra_node_bandwidth_gbps = nan\n",
     ["intra_node_bandwidth_gbps in [[groups]] #1 must be a positive number, got nan"]),
    ("infinite inter-node", "[inter_node]\nbandwidth_gbps = inf\n" + CLUSTER,
     ["bandwidth_gbps in [inter_node] must be a positive number, got inf"]),
    ("negative nodes", CLUSTER.replace("nodes = 2", "nodes = -2"),
     ["nodes in [[groups]] #1 must be a positive integer, got -2"]),
    ("unknown key", CLUSTER + "gpus = 3\n", ["unknown key 'gpus' in [[groups]] #1", "valid keys"]),
    ("unknown gpu", CLUSTER.replace('"h100"', '"h900"'), ["unknown gpu 'h900'", "valid GPUs"]),
    ("wrong type", CLUSTER.replace("nodes = 2", 'nodes = "two"'),
     ["nodes in [[groups]] #1 must be a positive integer, got 'two'"]),
    ("negative bandwidth", CLUSTER + "intra_node_bandwidth_gbps = -5\n",
     ["intra_node_bandwidth_gbps in [[groups]] #1 must be a positive number, got -5"]),
]


@pytest.mark.parametrize(("content", "needles"), [case[1:] for case in CLUSTER_CASES],
                         ids=[case[0] for case in CLUSTER_CASES])
def test_bad_cluster_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture,
                                     content: str | bytes, needles: list[str]) -> None:
    cluster = _write(tmp_path / "cluster.toml", content)
    refused(capsys, ["estimate", "--model", "gpt3-125m", "--cluster", str(cluster), "--tp", "1",
                     "--pp", "1", "--dp", "1"], *needles)


def test_bad_cluster_shorthand_is_refused(capsys: pytest.CaptureFixture) -> None:
    refused(capsys, ["plan", "--model", "gpt3-125m", "--cluster", "h100:0x8", "--global-batch", "8"],
            "a node group needs at least one node")


# --- model configs -----------------------------------------------------------------------------
MODEL_CASES = [
    ("empty", "", ["is empty", "catalog name"]),
    ("binary", BINARY, ["is not valid JSON"]),
    ("nan layers", json.dumps({**HF_GPT, "n_layer": float("nan")}),
     ["n_layer must be a positive integer, got nan"]),
    ("negative width", json.dumps({**HF_GPT, "n_embd": -64}),
     ["n_embd must be a positive integer, got -64"]),
    ("wrong type", json.dumps({**HF_GPT, "n_layer": "two"}),
     ["n_layer must be a positive integer, got 'two'"]),
    ("unknown layout", json.dumps({"layers": 2}), ["unknown config layout", "GPT-2 style"]),
    ("tying not bool", json.dumps({**HF_GPT, "tie_word_embeddings": "yes"}),
     ["tie_word_embeddings must be true or false, got 'yes'"]),
    ("not an object", "[]", ["must hold a JSON object, got list", "catalog name"]),
]


@pytest.mark.parametrize(("content", "needles"), [case[1:] for case in MODEL_CASES],
                         ids=[case[0] for case in MODEL_CASES])
def test_bad_model_config_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture,
                                     content: str | bytes, needles: list[str]) -> None:
    config = _write(tmp_path / "config.json", content)
    refused(capsys, ["estimate", "--model", str(config), "--cluster", "h100:1x8", "--tp", "1",
                     "--pp", "1", "--dp", "1"], *needles)


# --- arguments and output paths ----------------------------------------------------------------
def test_absurd_global_batch_is_refused_at_once_naming_the_limit(
        capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["plan", "--model", "gpt3-125m", "--cluster", "h100:1x8",
                  "--global-batch", "99999999999999999999"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "above the limit of 16,777,216 sequences (2**24)" in err and "Traceback" not in err


def test_non_numeric_global_batch_is_refused(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["plan", "--model", "gpt3-125m", "--cluster", "h100:1x8", "--global-batch", "1e3"])
    assert exit_info.value.code == 2
    assert "must be a whole number, got '1e3'" in capsys.readouterr().err


def test_nan_tolerance_is_refused(capsys: pytest.CaptureFixture) -> None:
    refused(capsys, ["plan", "--model", "gpt3-125m", "--cluster", "h100:1x8", "--global-batch", "8",
                     "--tolerance", "nan"], "--tolerance must be a finite fraction >= 0")


@pytest.mark.parametrize("flag", ["--json", "--chart"])
def test_output_under_a_file_is_refused_before_any_work(tmp_path: Path, flag: str,
                                                         capsys: pytest.CaptureFixture) -> None:
    blocker = _write(tmp_path / "notes.txt", "keep me")
    refused(capsys, ["estimate", "--model", "gpt3-125m", "--cluster", "h100:1x8", "--tp", "1",
                     "--pp", "1", "--dp", "8", flag, str(blocker / "out.json")],
            f"{flag} {blocker / 'out.json'}", "is not a folder")
    assert blocker.read_text() == "keep me"


def test_output_to_a_folder_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    refused(capsys, ["models", "--json", str(tmp_path)], f"--json {tmp_path} is a folder")


def test_unwritable_json_output_is_a_clear_error(capsys: pytest.CaptureFixture) -> None:
    refused(capsys, ["gpus", "--json", "/proc/version"], "cannot write /proc/version",
            "pass a writable path to --json")


def test_run_folder_under_a_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    job = _write(tmp_path / "job.toml", JOB)
    blocker = _write(tmp_path / "notes.txt", "keep me")
    refused(capsys, ["run", "--config", str(job), "--nproc", "2", "--out", str(blocker / "run")],
            f"cannot create run folder {blocker / 'run'}", "choose a writable --out")
    assert blocker.read_text() == "keep me"
