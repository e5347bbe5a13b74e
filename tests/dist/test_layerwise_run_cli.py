"""``meshmorph run`` trains the committed layerwise example on 4 gloo processes like one device,
and its ``state`` line puts every rank's measured bytes beside the prediction within 2%.

The job trains gpt-small on the synthetic task for three steps with the equivalence matrix's
optimizer; the one-device oracle (tests/helpers/reference.py) trains the same global batches (the
trainer's DataShard with one data-parallel rank) in float64, and the logged losses and gradient
norms are held to the matrix's rule: K x the largest deviation of three fp32 one-device runs.

A second test trains a mixed layerwise plan (ZeRO-1/2/3, tp4, a tied embedding) four steps with
a checkpoint every two, then resumes copies of the run folder from the step-2 checkpoint: under
the same plan (steps 3-4 bit for bit the uninterrupted losses) and under a uniform tp2 x dp2
ZeRO-3 plan with ``--reshard`` (within fp32 rounding).

Every ``meshmorph run`` of both tests is one background job of the session (``BACKGROUND_JOBS``,
tests/conftest.py); the tests read the run folders and outputs it leaves.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from meshmorph.run.data import DataShard, SampleOrder, SyntheticTask
from meshmorph.spec.catalog import catalog_model
from meshmorph.spec.plan import Plan
from tests.dist.test_layerwise_equivalence import EXAMPLE, TOLERANCE
from tests.helpers.oracle import K_FP32, OPTIM
from tests.helpers.oracle import worst as _worst
from tests.helpers.cli import run_cli
from tests.helpers.reference import deviation, reference_run
from tests.helpers.world import BACKGROUND_NICE, Job

STEPS = 3
SEED = 7
DATA_SEED = 3

JOB = f"""
[model]
source = "gpt-small"
seq_len = 128

[data]
kind = "synthetic"
seed = {DATA_SEED}

[train]
steps = {STEPS}
global_batch = 8
micro_batch = 2
seed = {SEED}
dtype = "fp32"

[optim]
lr = {OPTIM.lr}
min_lr = {OPTIM.min_lr}
warmup_steps = {OPTIM.warmup_steps}
decay_steps = {OPTIM.decay_steps}
weight_decay = {OPTIM.weight_decay}
eps = {OPTIM.eps}
grad_clip = {OPTIM.grad_clip}
"""


def _global_batches(plan: Plan) -> list[torch.Tensor]:
    model = catalog_model("gpt-small")
    source = SyntheticTask(vocab_size=model.vocab_size, seq_len=model.seq_len, seed=DATA_SEED)
    shard = DataShard(source, SampleOrder(len(source), DATA_SEED),
                      global_batch=plan.global_batch, dp_rank=0, dp_size=1)
    return [shard.batch(step * plan.global_batch) for step in range(STEPS)]


def _run(job: Path, plan_file: Path, out: Path, *extra: str) -> dict:
    """``meshmorph run`` of ``job`` under ``plan_file`` on 4 processes into ``out``, at the
    background's priority: its exit code and output."""
    code, output = run_cli(["run", "--config", str(job), "--plan", str(plan_file), "--nproc", "4",
                            "--out", str(out), *extra], timeout_s=600, nice=BACKGROUND_NICE)
    return {"code": code, "output": output}


def example_job(folder: Path, worlds: dict[str, Path | None]) -> None:
    """In the background: the layerwise example trained to its end into ``folder/run``."""
    job = folder / "job.toml"
    job.write_text(JOB)
    (folder / "done.json").write_text(json.dumps({"run": _run(job, EXAMPLE, folder / "run")}))


def resume_job(folder: Path, worlds: dict[str, Path | None]) -> None:
    """In the background: the mixed plan four steps into ``full``, then copies of that folder
    without the step-4 checkpoint resumed under the same plan (``resumed``) and under the uniform
    plan with ``--reshard`` (``resharded``); every run's code and output in ``done.json``."""
    from tests.dist.test_layerwise_equivalence import CKPT_LAYOUT, ckpt_uniform, layouts

    model, plan = layouts()[CKPT_LAYOUT]
    job, mixed, uniform = folder / "job.toml", folder / "mixed.json", folder / "uni.json"
    job.write_text(RESUME_JOB)
    mixed.write_text(json.dumps(plan.to_dict()))
    uniform.write_text(json.dumps(ckpt_uniform(model, plan).to_dict()))
    done = {"full": _run(job, mixed, folder / "full")}
    if done["full"]["code"] == 0:
        for name, plan_file, extra in (("resumed", mixed, ()),
                                       ("resharded", uniform, ("--reshard",))):
            out = folder / name
            shutil.copytree(folder / "full", out)
            shutil.rmtree(out / "checkpoints" / "step-4")  # as if stopped after the step-2 save
            done[name] = _run(job, plan_file, out, "--resume", *extra)
    (folder / "done.json").write_text(json.dumps(done))


BACKGROUND_JOBS = [Job("layerwise_example_run", example_job),
                   Job("layerwise_resume_runs", resume_job)]


def _output(done: dict, name: str) -> str:
    """The output of run ``name``, after checking it ran and ended with 0."""
    assert name in done, f"meshmorph run {name} did not run"
    assert done[name]["code"] == 0, done[name]["output"]
    return done[name]["output"]


@pytest.fixture(scope="module")
def example_folder(background: Callable[[str], Path]) -> Path:
    """The example job's folder, waited for here (not inside the test's timeout)."""
    return background("layerwise_example_run")


@pytest.fixture(scope="module")
def resume_folder(background: Callable[[str], Path]) -> Path:
    """The resume job's folder, waited for here (not inside the test's timeout)."""
    return background("layerwise_resume_runs")


@pytest.mark.dist
@pytest.mark.timeout(300, func_only=True)
def test_meshmorph_run_trains_the_layerwise_example_like_one_device(example_folder: Path) -> None:
    run_dir = example_folder / "run"
    output = _output(json.loads((example_folder / "done.json").read_text()), "run")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "event" not in row]
    assert [row["step"] for row in steps] == [1, 2, 3], output

    plan = Plan.load(EXAMPLE)
    model, data = catalog_model("gpt-small"), _global_batches(plan)
    fp64 = reference_run(model, OPTIM, data, seed=SEED, micro_batch=plan.micro_batch)
    noise = _worst([deviation(reference_run(model, OPTIM, data, seed=SEED, micro_batch=mb,
                                            precision="fp32"), fp64, OPTIM) for mb in (1, 2, 8)])
    for what, key, truth, base in (("loss", "loss", fp64.losses, noise.loss_rel),
                                   ("gradient norm", "grad_norm", fp64.grad_norms,
                                    noise.grad_norm_rel)):
        tolerance = K_FP32 * max(base, 1e-7)
        for row, want in zip(steps, truth, strict=True):
            gap = abs(row[key] - want) / want
            assert gap <= tolerance, (f"step {row['step']} {what} {row[key]} vs one device "
                                      f"{want}: rel diff {gap:.3g} > {tolerance:.3g}")

    (state,) = [row for row in rows if row.get("event") == "state"]
    assert [record["rank"] for record in state["ranks"]] == [0, 1, 2, 3]
    for record in state["ranks"]:
        measured, predicted = record["measured"], record["predicted"]
        for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
            assert abs(measured[key] - predicted[key]) <= TOLERANCE * predicted[key], (record, key)
        for kind, sent in measured["comm_bytes"].items():
            want = predicted["comm_bytes"].get(kind, 0)
            assert abs(sent - want) <= TOLERANCE * max(want, 1), (record["rank"], kind, sent, want)
    assert "largest gap 0.00%" in output, output


RESUME_JOB = """
[model]
source = "gpt-tiny"
seq_len = 16
[data]
kind = "synthetic"
seed = 1
[train]
steps = 4
global_batch = 8
micro_batch = 2
seed = 2
dtype = "fp32"
[optim]
lr = 3e-3
warmup_steps = 1
decay_steps = 4
[checkpoint]
every = 2
keep = 3
"""


def _losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if "event" not in row]


@pytest.mark.dist
@pytest.mark.timeout(120, func_only=True)
def test_meshmorph_run_resumes_a_layerwise_checkpoint_and_reshards_it_into_a_uniform_plan(
        resume_folder: Path) -> None:
    done = json.loads((resume_folder / "done.json").read_text())
    _output(done, "full")
    truth = _losses(resume_folder / "full")
    assert len(truth) == 4
    for name in ("resumed", "resharded"):
        output = _output(done, name)
        assert "resumed from" in output and "(step 2, 16 samples consumed)" in output, output
        got = _losses(resume_folder / name)[2:]
        if name == "resumed":
            assert got == truth[2:], f"resumed {got} vs uninterrupted {truth[2:]}"
        else:  # the same weights and moments, another summation order in fp32
            assert got == pytest.approx(truth[2:], rel=1e-6, abs=0), (got, truth[2:])
