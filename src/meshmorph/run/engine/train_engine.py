"""TrainEngine: runs one optimizer step of any Plan, with the numbers of a single device.

One step: this data-parallel rank's share of the global batch is cut into micro-batches that run
through this rank's model chunks, each chunk a sequence of segments (run/parallel/segments.py):
one for a uniform plan, one per run of layers sharing a strategy otherwise. Every micro-batch's
mean token loss is back-propagated as this rank's exact share of the global-batch mean, so the
accumulated gradient is that of the global-batch mean: divided by m (by hand, or by the pipeline
schedule) where torch's wrappers average over the dp ranks (a uniform plan), by m x the dp of
the layout the loss is taken in where every segment sums over its own dp group (a plan whose
layers differ: the last segment's layout at pp 1, the data layout at a pipeline stage's end;
torch's own 1/m would miss a ZeRO-2 layer's shards, whose gathered copies are registered at the
step's end). Gradients torch's wrappers do not reduce are reduced after the backward, tied
embedding copies on different pipeline ranks are summed (run/engine/grads.py), the global
gradient norm is taken over every shard once (run/engine/grad_norm.py), gradients are clipped on
the device, and AdamW and the LR schedule step. The tests' one-device oracle
(tests/dist/reference.py) runs the same arithmetic.

Precision: master parameters, gradients and Adam moments stay fp32; a 16-bit plan computes
under FSDP2's MixedPrecisionPolicy (segments FSDP2 shards) and ``torch.autocast`` (unless every
layer is cast by FSDP2), and an fp16 plan scales its loss (``LossScaler``). ZeRO-1 and ZeRO-2
keep the parameters FSDP2 gathered for the first micro-batch to the end of the step and reshard
them after the optimizer step; ZeRO-1 turns gradient sync off for every micro-batch but the
last, whose backward reduce-scatters each unit's accumulated gradients as it ends (with
``overlap_grad_reduce`` off: after the backward, unit by unit). The first step also records what
this rank holds at the end of backward and at every micro-batch boundary, and what it sends
(run/engine/state_line.py). A step reads the device once: the loss and the norm together.
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from meshmorph.run.config import OptimConfig
from meshmorph.run.engine import state_line
from meshmorph.run.engine.comm_count import CommCounter
from meshmorph.run.engine.grad_norm import clip_grads_, grad_norm
from meshmorph.run.engine.grads import (
    TiedCopies,
    align_grads_,
    all_reduce_grads_,
    hold_reduction,
    reduce_held,
)
from meshmorph.run.engine.loss_scale import LossScaler
from meshmorph.run.engine.optimizers import make_optimizers
from meshmorph.run.engine.pipeline import build_schedule, io_dtypes
from meshmorph.run.model.decoder import build_chunk
from meshmorph.run.model.loss import token_cross_entropy
from meshmorph.run.parallel.mesh import TrainMesh, build_mesh
from meshmorph.run.parallel.parallelize import TORCH_DTYPES, autocasts, parallelize
from meshmorph.run.parallel.segments import ParallelChunk
from meshmorph.spec.model import ModelSpec
from meshmorph.spec.plan import Plan
from meshmorph.spec.runnable import check_plan, defers_grad_reduce

__all__ = ["TrainEngine", "build_engine", "defers_grad_reduce", "validate_plan"]


def validate_plan(model: ModelSpec, plan: Plan, world_size: int, *,
                  cuda: bool | None = None) -> None:
    """Refuse, before any process group exists, a plan this model or job cannot run: the plan's
    own checks, then every rule of spec/runnable.py for ranks on CUDA devices (``cuda``; None:
    where this machine has one, as ``trainer.init_distributed`` decides)."""
    check_plan(model, plan, world_size, cuda=torch.cuda.is_available() if cuda is None else cuda)


class TrainEngine:
    """This rank's model chunks, their optimizers and the step that trains them."""

    def __init__(self, *, spec: ModelSpec, plan: Plan, optim: OptimConfig, mesh: TrainMesh,
                 chunks: list[ParallelChunk], device: torch.device) -> None:
        self.spec, self.plan, self.optim, self.device = spec, plan, optim, device
        self.train_mesh = mesh
        self.mesh: DeviceMesh = mesh.mesh
        self.dp_rank, self.dp_size = mesh.dp_rank, mesh.dp  # the trainer's data layout
        self.chunks = chunks
        self.chunk_ids = [chunk.index for chunk in chunks]
        self.model_parts: list[nn.Module] = [chunk.module for chunk in chunks]
        self._runners = [chunk.runner for chunk in chunks]  # DDP wrapper, chunk or SegmentRunner
        self.segments = [segment for chunk in chunks for segment in chunk.segments]
        # the parameters as registered now: FSDP2's sharded DTensors (ZeRO-2 keeps unsharded
        # ones registered on the modules between backward and the optimizer step)
        self._params = [chunk.params for chunk in chunks]
        self.part_optimizers: list[list[torch.optim.Optimizer]] = []
        """The optimizers over each model part, for checkpoints (run/checkpoint.py)."""
        self.optimizers: list[torch.optim.Optimizer] = []
        self.lr_schedulers: list[torch.optim.lr_scheduler.LRScheduler] = []
        for chunk in chunks:
            optimizers, schedulers = make_optimizers(chunk.segments, optim, device)
            self.part_optimizers.append(optimizers)
            self.optimizers += optimizers
            self.lr_schedulers += schedulers
        self.has_first = 0 in self.chunk_ids
        self.has_last = plan.num_chunks - 1 in self.chunk_ids
        self.scaler = LossScaler() if plan.dtype == "fp16" else None
        self._set_up_gradients()
        self.schedule = None
        if plan.pp > 1:
            self.schedule = build_schedule(self._runners, self.chunk_ids, spec, plan, mesh,
                                           device, self._stage_loss,
                                           scale_grads=not self.summed)
        self.tied = TiedCopies(spec, plan, [chunk.module for chunk in chunks], mesh)
        self._grad_norm = float("nan")
        self._autocast = (partial(torch.autocast, device.type, dtype=TORCH_DTYPES[plan.dtype])
                          if autocasts(plan) else contextlib.nullcontext)
        self.capture_state = True
        """Whether the next step records what this rank holds and sends (the first step does)."""
        self.captured_state: dict[str, object] | None = None
        """This rank's measured state of the captured step (run/engine/state_line.py), once taken."""
        self.state_written = False
        """Whether the state line of the captured step was written (run/engine/state_line.py)."""
        self._boundary_bytes = 0
        """The most parameter and gradient bytes at a micro-batch boundary of the captured step."""

    def _set_up_gradients(self) -> None:
        """What the step does to gradients besides the backward: its loss share, the ZeRO-2
        units it keeps gathered, holds or reshards, and the reductions left to it."""
        plan, segments = self.plan, self.segments
        self.summed = any(segment.per_layer for segment in segments)
        """Whether every segment sums its gradients over its own dp group (per-layer data
        parallelism); False: torch's wrappers average them over the plan's dp."""
        loss_dp = 1
        if self.summed:  # the dp of the layout the loss is taken in
            loss_dp = segments[-1].strategy.dp if plan.pp == 1 else plan.dp
        self._share = plan.num_microbatches * loss_dp if plan.pp == 1 or self.summed else 1
        """What a micro-batch's loss is divided by in its backward (1: the schedule divides)."""
        self._kept: list[FSDPModule] = [
            unit for segment in segments if segment.fsdp and segment.strategy.zero <= 2
            for unit in segment.fsdp_units]  # type: ignore[misc]
        """ZeRO-1/2's FSDP2 units: gathered once per step, resharded after the optimizer step."""
        # torch pipelining defers FSDP2's reduction only for a stage module that is an
        # FSDPModule; the units below a plain one wait for the weight passes here (grads.py)
        split = plan.pp > 1 and plan.schedule.split_backward
        self._held: list[FSDPModule] = [
            unit for chunk in self.chunks if split and not isinstance(chunk.runner, FSDPModule)
            for segment in chunk.segments if segment.strategy.zero == 2
            for unit in segment.fsdp_units]  # type: ignore[misc]
        dtype = TORCH_DTYPES[plan.reduce_dtype]
        self._late = [partial(all_reduce_grads_, [segment.params],
                              segment.mesh.dp_mesh.get_group(), dtype)
                      for segment in segments if segment.reduced_after_backward]
        """The reductions after the backward: each ZeRO 0/1 segment summed, or DDP's averaged."""
        runner = self._runners[0]
        if isinstance(runner, DistributedDataParallel) and defers_grad_reduce(plan):
            group = runner.process_group
            self._late.append(partial(all_reduce_grads_, [[p] for p in runner.module.parameters()],
                                      group, dtype, dist.get_world_size(group)))

    def _scaled_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """A micro-batch's mean loss, times the fp16 loss scale."""
        loss = token_cross_entropy(logits, labels)
        return loss * self.scaler.scale if self.scaler is not None else loss

    def _stage_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """A pipeline micro-batch's loss as the last stage back-propagates it."""
        loss = self._scaled_loss(logits, labels)
        return loss if self._share == 1 else loss / self._share

    # --- the step ------------------------------------------------------------------------------
    def _accumulate(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Gradient accumulation without a pipeline; returns the sum of micro-batch mean losses."""
        chunk, m = self.chunks[0], self.plan.num_microbatches
        model = chunk.runner
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        defer = defers_grad_reduce(self.plan)
        # ZeRO-1 on FSDP2 with overlap_grad_reduce off: no unit reduces in the backward, each
        # reduce-scatters once after it
        held = [model] if defer and isinstance(model, FSDPModule) else []
        hold_reduction(held)
        for i, (x, y) in enumerate(zip(inputs.chunk(m), labels.chunk(m), strict=True)):
            # zero 2/3 reduce-scatter every micro-batch; DDP and ZeRO-1's FSDP2 units reduce in
            # the last micro-batch's backward (overlap_grad_reduce) or after it (defer)
            sync = (i == m - 1 and not defer) or self.plan.zero >= 2
            if isinstance(model, FSDPModule) and not held:
                model.set_requires_gradient_sync(sync)
            no_sync = model.no_sync() if isinstance(model, DistributedDataParallel) and not sync \
                else contextlib.nullcontext()
            with no_sync:
                with self._autocast():
                    loss = self._scaled_loss(model(x), chunk.labels(y))
                (loss / self._share).backward()  # d(mean over the batch) = sum of d(loss_i) / share
            total += loss.detach().double()
            if self.capture_state and i < m - 1:  # a micro-batch boundary: what is held now
                self._boundary_bytes = max(self._boundary_bytes,
                                           state_line.state_bytes(state_line.held_bytes(self)))
        reduce_held(held)
        return total

    def _pipelined(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One step through torch pipelining; returns this rank's sum of its micro-batch mean
        losses (zero off the last stage)."""
        hold_reduction(self._held)  # reduced once, after every weight-gradient pass
        losses: list[torch.Tensor] = []
        with self._autocast():
            # return_outputs=False: the last stage would keep every micro-batch's logits (b s V
            # each) to the end of the step only to hand them back; the losses are all it needs
            self.schedule.step(*((inputs,) if self.has_first else ()),  # type: ignore[union-attr]
                               target=labels if self.has_last else None,
                               losses=losses if self.has_last else None, return_outputs=False)
        reduce_held(self._held)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for loss in losses:
            total += loss.detach().double() * self._share
        return total

    def _forward_backward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Check the step's tokens, clear the gradients, run every micro-batch's forward and
        backward (accumulated or pipelined) and the reductions left after it; returns this
        rank's loss sum."""
        plan = self.plan
        expected = (plan.global_batch // plan.dp, plan.seq_len + 1)
        if tuple(tokens.shape) != expected:
            raise ValueError(f"step() takes tokens of shape {list(expected)} (global_batch / dp, "
                             f"seq_len + 1), got {list(tokens.shape)}")
        tokens = tokens.to(self.device)
        inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        for module in self._kept:
            module.set_reshard_after_backward(False)  # gathered once, kept to the step's end
        total = self._accumulate(inputs, labels) if self.schedule is None \
            else self._pipelined(inputs, labels)
        for reduce in self._late:
            reduce()
        return total

    def step(self, tokens: torch.Tensor) -> float:
        """Train on this dp rank's share of one global batch, LongTensor[G / dp, s + 1]; returns
        the mean token loss over the whole global batch (identical on every rank). The first
        call also records this rank's state (``captured_state``)."""
        if not self.capture_state:
            return self._step(tokens)
        counter = CommCounter()
        self._boundary_bytes = 0
        with counter:
            loss = self._step(tokens)
        assert self.captured_state is not None
        self.captured_state["optimizer_bytes"] = state_line.optimizer_bytes(self)
        if self.schedule is None:  # the micro-batch boundaries this engine saw
            self.captured_state["peak_state_bytes"] = self.captured_state["optimizer_bytes"] \
                + max(self._boundary_bytes, state_line.state_bytes(self.captured_state))
        self.captured_state["comm_bytes"] = dict(counter.sent_bytes)
        self.capture_state = False
        return loss

    def _step(self, tokens: torch.Tensor) -> float:
        plan = self.plan
        loss_sum = self._forward_backward(tokens)
        if self.capture_state:  # the end of backward, before anything touches the gradients
            self.captured_state = state_line.held_bytes(self)
        params = [p for params in self._params for p in params]
        align_grads_(params)
        self.tied.sum_grads_()  # on gradients laid out as their parameters
        grads = [p.grad for p in params if p.grad is not None]
        if self.scaler is not None:
            loss_sum /= self.scaler.scale
            self.scaler.unscale_(grads)
        norm = grad_norm(self.segments, self.train_mesh, self.tied.head_copies, self.device)
        if self.scaler is None or self.scaler.update(float(norm)):
            if self.optim.grad_clip > 0:
                clip_grads_(grads, norm, self.optim.grad_clip)
            for opt in self.optimizers:
                opt.step()
        for sched in self.lr_schedulers:
            sched.step()
        for module in self._kept:
            module.reshard()  # the next step gathers the updated weights
        # every last-stage rank holds the sum of its m micro-batch means; tp ranks repeat it
        if not self.has_last:
            loss_sum.zero_()
        dist.all_reduce(loss_sum)
        loss, self._grad_norm = torch.stack((loss_sum, norm.to(loss_sum))).tolist()  # one read
        return loss / (plan.num_microbatches * plan.dp * plan.tp)

    def grad_norm_last(self) -> float:
        """The global gradient norm of the last step, before clipping."""
        return self._grad_norm


def build_engine(model: ModelSpec, plan: Plan, optim: OptimConfig, *, seed: int,
                 device: torch.device) -> TrainEngine:
    """This rank's part of ``plan``: model chunks built from ``seed``, parallelized segment by
    segment, with optimizers and (pp > 1) the pipeline schedule. torch.distributed must be
    initialised."""
    if not dist.is_initialized():
        raise RuntimeError("build_engine needs torch.distributed initialised "
                           "(launch with torchrun, or call init_process_group first)")
    validate_plan(model, plan, dist.get_world_size(), cuda=device.type == "cuda")
    mesh = build_mesh(plan, device.type)
    hidden, logits = io_dtypes(plan)  # what torch pipelining sends between stages
    chunks = []
    for index in plan.chunks_of(mesh.pp_rank):
        stage = plan.stages[index]
        boundary = None if plan.pp == 1 else logits if index == plan.num_chunks - 1 else hidden
        # built on the meta device; parallelize allocates and fills only this rank's shards
        chunk = build_chunk(model, stage.start, stage.stop, seed=seed, device="meta")
        chunks.append(parallelize(chunk, model, plan, index, mesh, seed=seed, device=device,
                                  boundary_dtype=boundary))
    return TrainEngine(spec=model, plan=plan, optim=optim, mesh=mesh, chunks=chunks,
                       device=device)
