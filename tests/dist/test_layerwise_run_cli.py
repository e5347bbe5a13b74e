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
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshmorph.run.data import DataShard, SampleOrder, SyntheticTask
from meshmorph.spec.catalog import catalog_model
from meshmorph.spec.plan import Plan
from tests.dist.test_layerwise_equivalence import EXAMPLE, TOLERANCE
from tests.helpers.oracle import K_FP32, OPTIM
from tests.helpers.oracle import worst as _worst
from tests.helpers.reference import deviation, reference_run

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


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_meshmorph_run_trains_the_layerwise_example_like_one_device(tmp_path: Path) -> None:
    job, run_dir = tmp_path / "job.toml", tmp_path / "run"
    job.write_text(JOB)
    done = subprocess.run([sys.executable, "-m", "meshmorph.cli.app", "run", "--config", str(job),
                           "--plan", str(EXAMPLE), "--nproc", "4", "--out", str(run_dir)],
                          capture_output=True, text=True, timeout=240)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
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
@pytest.mark.timeout(420)
def test_meshmorph_run_resumes_a_layerwise_checkpoint_and_reshards_it_into_a_uniform_plan(
        tmp_path: Path) -> None:
    import shutil

    from tests.dist.test_layerwise_equivalence import CKPT_LAYOUT, ckpt_uniform, layouts

    model, plan = layouts()[CKPT_LAYOUT]
    job, mixed, uniform = tmp_path / "job.toml", tmp_path / "mixed.json", tmp_path / "uni.json"
    job.write_text(RESUME_JOB)
    mixed.write_text(json.dumps(plan.to_dict()))
    uniform.write_text(json.dumps(ckpt_uniform(model, plan).to_dict()))

    def run(plan_file: Path, out: Path, *extra: str) -> str:
        done = subprocess.run([sys.executable, "-m", "meshmorph.cli.app", "run", "--config", str(job),
                               "--plan", str(plan_file), "--nproc", "4", "--out", str(out),
                               *extra], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout + done.stderr

    full = tmp_path / "full"
    run(mixed, full)
    truth = _losses(full)
    assert len(truth) == 4
    for name, plan_file, extra in (("resumed", mixed, ()), ("resharded", uniform, ("--reshard",))):
        out = tmp_path / name
        shutil.copytree(full, out)
        shutil.rmtree(out / "checkpoints" / "step-4")  # as if stopped after the step-2 save
        output = run(plan_file, out, "--resume", *extra)
        assert "resumed from" in output and "(step 2, 16 samples consumed)" in output, output
        got = _losses(out)[2:]
        if name == "resumed":
            assert got == truth[2:], f"resumed {got} vs uninterrupted {truth[2:]}"
        else:  # the same weights and moments, another summation order in fp32
            assert got == pytest.approx(truth[2:], rel=1e-6, abs=0), (got, truth[2:])
