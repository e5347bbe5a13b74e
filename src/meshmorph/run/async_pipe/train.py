"""``meshmorph run`` of a plan with ``schedule = "async"``: the job's model and data through the
asynchronous pipeline executor (``run/async_pipe/executor.py``), one model chunk per rank
(docs/pipelines.md, "Run by ``meshmorph run``", says what a logged step is and what is left out).

Pipeline rank ``k`` builds chunk ``k`` of the plan (``build_chunk``: the weights the whole model
would hold) and trains it without flush. Under ``none``, ``stash``, ``sgd`` and ``adam`` every
micro-batch is an update of every stage, so a logged step of ``m`` micro-batches is ``m``
updates and its loss the mean of theirs; under ``2bw`` a step is one update per stage. The
optimizer is the job's AdamW (``sgd`` prediction: momentum SGD, momentum ``beta1``, no weight
decay), update ``u`` at the learning rate of step ``u // m`` (step ``u`` under ``2bw``). No
gradient clipping or norm (``grad_norm`` is logged as NaN), no sum of a tied embedding's two
gradients, no checkpoints; the last pipeline rank writes the metrics.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from meshmorph.run.async_pipe.config import AsyncPipelineConfig
from meshmorph.run.async_pipe.executor import AsyncPipeline
from meshmorph.run.config import OptimConfig
from meshmorph.run.data import DataShard, SampleOrder, SampleSource
from meshmorph.run.metrics import MetricsLogger
from meshmorph.run.model.decoder import build_chunk
from meshmorph.run.model.float8 import cast_inputs_under_autocast_, convert_for_plan_
from meshmorph.run.model.loss import token_cross_entropy
from meshmorph.run.parallel.parallelize import TORCH_DTYPES
from meshmorph.spec.model import ModelSpec
from meshmorph.spec.plan import Plan, PlanError
from meshmorph.spec.runnable import async_job_refusal, check_runnable


class _Fp32Output(nn.Module):
    """A chunk whose output goes to the next rank in fp32 (what the receiver allocates)."""

    def __init__(self, chunk: nn.Module, last: bool) -> None:
        super().__init__()
        self.chunk, self.last = chunk, last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.chunk(x)
        return out if self.last else out.float()


def async_config(plan: Plan, optim: OptimConfig) -> AsyncPipelineConfig:
    """The executor's configuration for ``plan`` under the job's optimizer settings."""
    sgd = plan.weight_prediction == "sgd"
    return AsyncPipelineConfig(
        weight_prediction=plan.weight_prediction, num_microbatches=plan.num_microbatches,
        optimizer="sgd" if sgd else "adamw", lr=optim.lr, momentum=optim.beta1,
        betas=(optim.beta1, optim.beta2), eps=optim.eps,
        weight_decay=0.0 if sgd else optim.weight_decay, guard_threshold=None)


def train_async(*, model: ModelSpec, plan: Plan, optim: OptimConfig, batch_of_step:
                Callable[[int], torch.Tensor], steps: int, seed: int, out_dir: Path,
                device: torch.device) -> list[float]:
    """Train ``steps`` steps of ``plan`` (``batch_of_step(step)``: that step's global batch,
    LongTensor[G, s + 1]); writes metrics.jsonl from the last rank and returns the step losses
    there (empty elsewhere). torch.distributed must be initialised with pp ranks."""
    check_runnable(model, plan)  # spec/runnable.py: the executor's rules
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != plan.pp:
        raise PlanError(f"schedule 'async' runs pp {plan.pp} ranks, the job has {world}")
    stage = plan.stages[rank]
    chunk = build_chunk(model, stage.start, stage.stop, seed=seed, device=device)
    if convert_for_plan_(chunk, plan):  # dtype fp8: the blocks' linears multiply in float8
        cast_inputs_under_autocast_(chunk)
    last = rank == plan.pp - 1
    config = async_config(plan, optim)
    # the executor's batches (and each stage's updates) per logged step: one batch of m
    # micro-batches under 2bw, else m batches of one micro-batch
    per_step = 1 if plan.weight_prediction == "2bw" else plan.num_microbatches
    autocast: Callable[[], contextlib.AbstractContextManager[object]] = (
        (lambda: torch.autocast(device.type, dtype=TORCH_DTYPES[plan.dtype]))
        if plan.dtype != "fp32" else contextlib.nullcontext)
    pipeline = AsyncPipeline(
        _Fp32Output(chunk, last), config,
        feature_shapes=[(plan.seq_len,)] + [(plan.seq_len, model.hidden_size)] * (plan.pp - 1),
        loss_fn=token_cross_entropy, lr_at=lambda version: optim.lr_at(version // per_step),
        forward_context=autocast)
    rows = plan.global_batch // per_step
    step_batch = lru_cache(maxsize=1)(lambda step: batch_of_step(step).to(device))

    def batch(index: int) -> tuple[torch.Tensor, torch.Tensor]:
        step, piece = divmod(index, per_step)
        tokens = step_batch(step)[piece * rows:(piece + 1) * rows]
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    metrics = MetricsLogger(out_dir, enabled=last, total_steps=steps, start_step=0,
                            tokens_per_step=plan.global_batch * plan.seq_len)
    losses: list[float] = []
    pending: list[float] = []
    clock = [time.perf_counter()]

    def on_loss(index: int, loss: float) -> None:
        pending.append(loss)
        if len(pending) < per_step:
            return
        step = len(losses) + 1
        now = time.perf_counter()
        # the mean of the step's batches (a batch of micro-batches is already their mean: the
        # executor divides)
        losses.append(sum(pending) / len(pending))
        pending.clear()
        metrics.log(step=step, loss=losses[-1], lr=optim.lr_at(step - 1), grad_norm=math.nan,
                    step_time_s=now - clock[0], consumed_samples=step * plan.global_batch)
        clock[0] = now

    try:
        pipeline.train(batch, steps * per_step, rows, on_loss=on_loss)
    finally:
        metrics.close()
    return losses


def run_async_job(*, model: ModelSpec, plan: Plan, optim: OptimConfig, source: SampleSource,
                  data_seed: int, steps: int, seed: int, out_dir: Path, device: torch.device,
                  resume: bool, elastic: object) -> int:
    """``meshmorph run``'s training loop for an asynchronous plan (``trainer.train`` hands it
    over); the job's data in the job's sample order, the step's batch as the engine sees it."""
    refusal = async_job_refusal(plan, resume=resume, elastic=elastic is not None)
    if refusal is not None:
        raise PlanError(refusal)
    shard = DataShard(source, SampleOrder(len(source), data_seed),
                      global_batch=plan.global_batch, dp_rank=0, dp_size=1)
    losses = train_async(model=model, plan=plan, optim=optim,
                         batch_of_step=lambda step: shard.batch(step * plan.global_batch),
                         steps=steps, seed=seed, out_dir=out_dir, device=device)
    if dist.get_rank() == plan.pp - 1:
        print(f"finished at step {len(losses)} (schedule async, weight_prediction "
              f"{plan.weight_prediction}); metrics in {out_dir / 'metrics.jsonl'}; no "
              f"checkpoint (asynchronous runs save none)", flush=True)
    return 0
