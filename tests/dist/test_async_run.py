"""``meshmorph run`` of an asynchronous plan (schedule async, weight stashing) on 4 gloo
processes: the logged step losses equal a one-process PipeDream reference on the same model
chunks, data and optimizer, where stage k's forward and backward of micro-batch j use its weights
after max(0, j - (pp - 1 - k)) updates and every micro-batch updates every stage."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.func import functional_call

from meshmorph.run.data import DataShard, SampleOrder
from meshmorph.run.job import load_job
from meshmorph.run.model.loss import token_cross_entropy
from meshmorph.run.model.decoder import build_chunk
from meshmorph.run.trainer import make_source
from meshmorph.spec.catalog import load_model
from meshmorph.spec.plan import Plan

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
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


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_async_stash_run_logs_the_pipedream_reference_losses(tmp_path: Path) -> None:
    job_path = tmp_path / "job.toml"
    job_path.write_text((EXAMPLES / "jobs" / "text-file.toml").read_text()
                        .replace("steps = 60", f"steps = {STEPS}")
                        .replace('"../data/tiny.txt"', f'"{EXAMPLES / "data" / "tiny.txt"}"'))
    model = load_model("gpt-tiny", 32)
    plan = Plan(model="gpt-tiny", seq_len=32, global_batch=8, pp=PP, micro_batch=2,
                num_microbatches=4, schedule="async", weight_prediction="stash",
                dtype="fp32").with_even_stages(model)
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(plan.to_json())
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "meshmorph.cli.app", "run", "--config",
                           str(job_path), "--nproc", str(PP), "--plan", str(plan_path), "--out",
                           str(run_dir)], capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
    rows = [r for r in rows if "event" not in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["consumed_samples"] for r in rows] == [8 * s for s in range(1, STEPS + 1)]
    logged = [r["loss"] for r in rows]
    stash = pipedream_losses(job_path, plan, lambda k, j: max(0, j - (PP - 1 - k)))
    assert logged == pytest.approx(stash, rel=1e-5, abs=1e-6)
    # the check can tell: fresh weights everywhere (synchronous per micro-batch) differ
    fresh = pipedream_losses(job_path, plan, lambda k, j: j)
    assert max(abs(a - b) for a, b in zip(fresh, logged, strict=True)) > 1e-3
