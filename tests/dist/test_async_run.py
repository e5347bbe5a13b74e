"""``meshmorph run`` of an asynchronous plan (schedule async, weight stashing) on 4 gloo
processes: the logged step losses equal a one-process PipeDream reference on the same model
chunks, data and optimizer, where stage k's forward and backward of micro-batch j use its weights
after max(0, j - (pp - 1 - k)) updates and every micro-batch updates every stage.

The run is a background job of the session (``BACKGROUND_JOBS``, tests/conftest.py); the test
computes the reference and reads the run's metrics."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.func import functional_call

from meshmorph.run.data import DataShard, SampleOrder
from meshmorph.run.job import load_job
from meshmorph.run.model.decoder import build_chunk
from meshmorph.run.model.loss import token_cross_entropy
from meshmorph.run.data import make_source
from meshmorph.spec.catalog import load_model
from meshmorph.spec.plan import Plan
from tests.helpers.cli import records, run_cli
from tests.helpers.jobs import text_file_job, write_job
from tests.helpers.world import BACKGROUND_NICE, Job

STEPS, PP = 5, 4


def pipedream_losses(job_path: Path, plan: Plan, version: object) -> list[float]:
    """Step losses of the one-process reference; ``version(k, j)``: how many updates of stage k
    micro-batch j's forward and backward see."""
    job = load_job(job_path)
    model = load_model(job.model.source, job.model.seq_len)
    shard = DataShard(make_source(job, model), SampleOrder(len(make_source(job, model)),
                                                           job.data.seed),
                      global_batch=plan.global_batch, dp_rank=0, dp_size=1)
    chunks = [build_chunk(model, s.start, s.stop, seed=job.train.seed) for s in plan.stages]
    optim = job.optim
    opts = [torch.optim.AdamW(c.parameters(), lr=optim.lr, betas=(optim.beta1, optim.beta2),
                              eps=optim.eps, weight_decay=optim.weight_decay) for c in chunks]
    history = [[{n: p.detach().clone() for n, p in c.named_parameters()}] for c in chunks]
    m, rows = plan.num_microbatches, plan.micro_batch
    losses: list[float] = []
    for j in range(STEPS * m):
        step, piece = divmod(j, m)
        tokens = shard.batch(step * plan.global_batch)[piece * rows:(piece + 1) * rows]
        x, y = tokens[:, :-1], tokens[:, 1:]
        leaves = [{n: t.clone().requires_grad_() for n, t in history[k][version(k, j)].items()}
                  for k in range(PP)]
        for k, chunk in enumerate(chunks):
            x = functional_call(chunk, leaves[k], (x,))
        loss = token_cross_entropy(x, y)
        loss.backward()
        losses.append(float(loss.detach()))
        for k, chunk in enumerate(chunks):
            for name, param in chunk.named_parameters():
                param.grad = leaves[k][name].grad
            for group in opts[k].param_groups:
                group["lr"] = optim.lr_at(j // m)
            opts[k].step()
            history[k].append({n: p.detach().clone() for n, p in chunk.named_parameters()})
    return [sum(losses[s * m:(s + 1) * m]) / m for s in range(STEPS)]


def _plan() -> Plan:
    return Plan(model="gpt-tiny", seq_len=32, global_batch=8, pp=PP, micro_batch=2,
                num_microbatches=4, schedule="async", weight_prediction="stash",
                dtype="fp32").with_even_stages(load_model("gpt-tiny", 32))


def run_job(folder: Path, worlds: dict[str, Path | None]) -> None:
    """``meshmorph run`` of the async plan, its exit code and output kept in the folder."""
    job_path = write_job(folder, text_file_job(steps=STEPS))
    plan_path = folder / "plan.json"
    plan_path.write_text(_plan().to_json())
    code, output = run_cli(["run", "--config", str(job_path), "--nproc", str(PP), "--plan",
                            str(plan_path), "--out", str(folder / "run")], timeout_s=600,
                           nice=BACKGROUND_NICE)
    (folder / "done.json").write_text(json.dumps({"code": code, "output": output}))


BACKGROUND_JOBS = [Job("async_run", run_job)]


@pytest.fixture(scope="module")
def async_folder(background: Callable[[str], Path]) -> Path:
    """The job's folder, waited for here (not inside the test's timeout)."""
    return background("async_run")


@pytest.mark.dist
@pytest.mark.timeout(120, func_only=True)
def test_async_stash_run_logs_the_pipedream_reference_losses(
        async_folder: Path) -> None:
    folder = async_folder
    done = json.loads((folder / "done.json").read_text())
    assert done["code"] == 0, done["output"]
    job_path, plan, run_dir = folder / "job.toml", _plan(), folder / "run"
    rows = records(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["consumed_samples"] for r in rows] == [8 * s for s in range(1, STEPS + 1)]
    logged = [r["loss"] for r in rows]
    stash = pipedream_losses(job_path, plan, lambda k, j: max(0, j - (PP - 1 - k)))
    assert logged == pytest.approx(stash, rel=1e-5, abs=1e-6)
    # the check can tell: fresh weights everywhere (synchronous per micro-batch) differ
    fresh = pipedream_losses(job_path, plan, lambda k, j: j)
    assert max(abs(a - b) for a, b in zip(fresh, logged, strict=True)) > 1e-3
