"""TrainEngine: runs one optimizer step of any Plan, with the numbers of a single device.

One step: this data-parallel rank's share of the global batch is cut into micro-batches; each
micro-batch's mean token loss is back-propagated scaled by 1/m (by hand, or by the pipeline
schedule), data parallelism averages over the dp ranks, so the accumulated gradient is that of
the global-batch mean. Tied embedding copies on different pipeline ranks are summed, the global
gradient norm is taken over every shard once, gradients are clipped, and AdamW and the LR
schedule step. The tests' one-device oracle (tests/dist/reference.py) runs the same arithmetic.

Precision: parameters, gradients and Adam moments stay fp32; a 16-bit plan computes under FSDP2's
MixedPrecisionPolicy (zero 2/3) or ``torch.autocast`` (everything else), and an fp16 plan scales
its loss (``LossScaler``). ZeRO-2 keeps the parameters FSDP2 gathered for the first micro-batch
to the end of the step and reshards them after the optimizer step. The first step also records
what this rank holds at the end of backward and sends (run/engine/state_line.py).
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from meshmorph.run.config import OptimConfig
from meshmorph.run.engine import state_line
from meshmorph.run.engine.comm_count import CommCounter
from meshmorph.run.engine.grad_norm import clip_grads_, global_grad_norm
from meshmorph.run.engine.loss_scale import LossScaler
from meshmorph.run.engine.pipeline import build_schedule
from meshmorph.run.model.decoder import Transformer, build_chunk
from meshmorph.run.model.loss import token_cross_entropy
from meshmorph.run.parallel.mesh import TrainMesh, build_mesh
from meshmorph.run.parallel.parallelize import TORCH_DTYPES, parallelize, uses_fsdp_precision
from meshmorph.run.parallel.zero1 import ShardedAdamW
from meshmorph.spec.model import ModelSpec
from meshmorph.spec.plan import Plan
from meshmorph.spec.runnable import check_runnable, defers_grad_reduce

__all__ = ["TrainEngine", "build_engine", "defers_grad_reduce", "validate_plan"]


def validate_plan(model: ModelSpec, plan: Plan, world_size: int) -> None:
    """Refuse, before any process group exists, a plan this model or job cannot run: the plan's
    own checks, then every rule of spec/runnable.py."""
    plan.check_against(model, world_size)
    check_runnable(model, plan)


def _make_optimizer(params: list[nn.Parameter], optim: OptimConfig, *,
                    device: torch.device | None = None, mesh: TrainMesh | None = None,
                    zero: int = 0
                    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW (fused on CUDA, foreach elsewhere) and its LR schedule; ZeRO-1 over dp > 1 shards
    the moments (run/parallel/zero1.py)."""
    fused = device is not None and device.type == "cuda"
    kw = dict(lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps,
              weight_decay=optim.weight_decay)
    opt: torch.optim.Optimizer
    if zero == 1 and mesh is not None and mesh.dp > 1:
        opt = ShardedAdamW(params, dp_mesh=mesh.sub("dp"),
                           dp_tp_mesh=mesh.sub("dp", "tp") if mesh.tp > 1 else None,
                           foreach=not fused, fused=fused, **kw)  # type: ignore[arg-type]
    else:
        opt = torch.optim.AdamW(params, foreach=not fused, fused=fused, **kw)  # type: ignore[arg-type]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: optim.lr_at(step) / optim.lr)
    return opt, sched


class TrainEngine:
    """This rank's model chunks, their optimizers and the step that trains them."""

    def __init__(self, *, spec: ModelSpec, plan: Plan, optim: OptimConfig, mesh: TrainMesh,
                 model_parts: list[Transformer], runners: list[nn.Module], chunk_ids: list[int],
                 device: torch.device) -> None:
        self.spec, self.plan, self.optim, self.device = spec, plan, optim, device
        self.train_mesh = mesh
        self.mesh: DeviceMesh = mesh.mesh
        self.dp_rank, self.dp_size = mesh.dp_rank, mesh.dp
        self.model_parts: list[nn.Module] = list(model_parts)
        self._runners = runners  # what runs each part: a DDP wrapper or the part itself
        self.chunk_ids = chunk_ids
        # the parameters as registered now: FSDP2's sharded DTensors (ZeRO-2 keeps unsharded
        # ones registered on the modules between backward and the optimizer step)
        self._params = [list(part.parameters()) for part in model_parts]
        pairs = [_make_optimizer(params, optim, device=device, mesh=mesh, zero=plan.zero)
                 for params in self._params]
        self.optimizers = [opt for opt, _ in pairs]
        self.lr_schedulers = [sched for _, sched in pairs]
        self.has_first = 0 in chunk_ids
        self.has_last = plan.num_chunks - 1 in chunk_ids
        self.scaler = LossScaler() if plan.dtype == "fp16" else None
        self.schedule = None
        if plan.pp > 1:
            self.schedule = build_schedule(runners, chunk_ids, spec, plan, mesh, device,
                                           self._scaled_loss)
        # under a V (zbv, dualpipev) pipeline rank 0 holds both the embedding and the head
        self._tied_local = spec.tied_embeddings and plan.pp > 1 and \
            plan.pp_rank_of_chunk(plan.num_chunks - 1) == 0
        self._tied_group = None if self._tied_local else self._make_tied_group()
        self._grad_norm = float("nan")
        # FSDP2's MixedPrecisionPolicy casts zero 2/3's parameters; autocast everywhere else
        self._autocast = (partial(torch.autocast, device.type, dtype=TORCH_DTYPES[plan.dtype])
                          if plan.dtype != "fp32" and not uses_fsdp_precision(plan)
                          else contextlib.nullcontext)
        self._fsdp_modules = [m for part in model_parts for m in part.modules()
                              if isinstance(m, FSDPModule)]
        self.capture_state = True
        """Whether the next step records what this rank holds and sends (the first step does)."""
        self.captured_state: dict[str, object] | None = None
        """This rank's measured state of the captured step (run/engine/state_line.py), once taken."""
        self.state_written = False
        """Whether the state line of the captured step was written (run/engine/state_line.py)."""

    def _scaled_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """A micro-batch's mean loss, times the fp16 loss scale."""
        loss = token_cross_entropy(logits, labels)
        return loss * self.scaler.scale if self.scaler is not None else loss

    # --- tied embeddings across pipeline ranks ------------------------------------------------
    def _make_tied_group(self) -> dist.ProcessGroup | None:
        """Group of the two pipeline ranks that hold the embedding and the tied head copy."""
        if not self.spec.tied_embeddings or self.plan.pp == 1:
            return None
        if self.plan.pp == 2:
            return self.train_mesh.group("pp")
        mine = None
        for dp_rank in range(self.plan.dp):  # every rank creates every group, in the same order
            for tp_rank in range(self.plan.tp):
                ranks = [self.plan.rank_of(0, dp_rank, tp_rank),
                         self.plan.rank_of(self.plan.pp - 1, dp_rank, tp_rank)]
                group = dist.new_group(ranks)
                if dist.get_rank() in ranks:
                    mine = group
        return mine

    def _tied_copies(self) -> list[nn.Parameter]:
        copies = []
        for part in self.model_parts:
            if part.embed is not None:
                copies.append(part.embed.tok.weight)
            if part.head is not None and self.spec.tied_embeddings:
                copies.append(part.head.out.weight)
        return copies

    def _align_grads(self) -> None:
        """Give every DTensor gradient its parameter's placements (tensor parallelism can leave a
        gradient Partial or Replicate where the parameter is sharded)."""
        for params in self._params:
            for param in params:
                grad = param.grad
                if isinstance(grad, DTensor) and grad.placements != param.placements:
                    param.grad = grad.redistribute(param.device_mesh, param.placements)

    def _sync_tied_grads(self) -> None:
        """Sum the gradients of the embedding and its head copy (pipeline ranks 0 and pp-1,
        or both on rank 0 under a V)."""
        if self._tied_local:
            copies = [_local(p.grad) for p in self._tied_copies() if p.grad is not None]
            if len(copies) == 2:
                total = copies[0] + copies[1]
                for grad in copies:
                    grad.copy_(total)
            return
        if self._tied_group is None:
            return
        copies = [p for p in self._tied_copies() if p.grad is not None]
        if not copies:
            return
        local = [_local(p.grad) for p in copies]
        total = torch.stack(local).sum(0) if len(local) > 1 else local[0].clone()
        dist.all_reduce(total, group=self._tied_group)
        for grad in local:
            grad.copy_(total)

    def _norm_params(self) -> list[nn.Parameter]:
        """Every parameter once: a head copy of a tied embedding on a later rank is not counted."""
        skip = set()
        if self._tied_group is not None or self._tied_local:
            skip = {id(part.head.out.weight) for part in self.model_parts
                    if part.head is not None and part.embed is None}
        return [p for params in self._params for p in params
                if p.grad is not None and id(p) not in skip]

    # --- the step ------------------------------------------------------------------------------
    def _accumulate(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Gradient accumulation without a pipeline; returns the sum of micro-batch mean losses."""
        model, m = self._runners[0], self.plan.num_microbatches
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        if isinstance(model, FSDPModule) and self.plan.zero == 2:
            # gathered once for the first micro-batch, kept to the end of the step
            model.set_reshard_after_backward(False)
        defer = isinstance(model, DistributedDataParallel) and defers_grad_reduce(self.plan)
        for i, (x, y) in enumerate(zip(inputs.chunk(m), labels.chunk(m), strict=True)):
            # zero 2/3 reduce-scatter every micro-batch; DDP reduces in the last micro-batch's
            # backward (overlap_grad_reduce) or after it (defer)
            sync = (i == m - 1 and not defer) or self.plan.zero >= 2
            if isinstance(model, FSDPModule):
                model.set_requires_gradient_sync(sync)
            no_sync = model.no_sync() if isinstance(model, DistributedDataParallel) and not sync \
                else contextlib.nullcontext()
            with no_sync:
                with self._autocast():
                    loss = self._scaled_loss(model(x), y)
                (loss / m).backward()  # d(mean over m micro-batches) = sum of d(loss_i) / m
            total += loss.detach().double()
        if defer:
            self._reduce_after_backward(model)
        return total

    def _reduce_after_backward(self, model: DistributedDataParallel) -> None:
        """``overlap_grad_reduce`` off: average every gradient over the dp group after the
        backward, as DDP's reducer would (each divided by dp first, in the plan's
        ``reduce_dtype``: DDP's 16-bit compress hooks cast, divide, reduce and copy back)."""
        group = model.process_group
        dtype = TORCH_DTYPES[self.plan.reduce_dtype]
        pending = []
        for param in model.module.parameters():
            if param.grad is None:
                continue
            wire = param.grad if param.grad.dtype == dtype else param.grad.to(dtype)
            wire.div_(dist.get_world_size(group))
            pending.append((dist.all_reduce(wire, group=group, async_op=True), param.grad, wire))
        for work, grad, wire in pending:
            work.wait()
            if wire is not grad:
                grad.copy_(wire)

    def _pipelined(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        target = labels if self.has_last else None
        with self._autocast():
            # return_outputs=False: the last stage would keep every micro-batch's logits (b s V
            # each) to the end of the step only to hand them back; the losses are all it needs
            self.schedule.step(*args, target=target, losses=losses if self.has_last else None,
                               return_outputs=False)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for loss in losses:
            total += loss.detach().double()
        return total

    def step(self, tokens: torch.Tensor) -> float:
        """Train on this dp rank's share of one global batch, LongTensor[G / dp, s + 1]; returns
        the mean token loss over the whole global batch (identical on every rank). The first
        call also records this rank's state (``captured_state``)."""
        if not self.capture_state:
            return self._step(tokens)
        counter = CommCounter()
        with counter:
            loss = self._step(tokens)
        assert self.captured_state is not None
        self.captured_state["optimizer_bytes"] = state_line.optimizer_bytes(self)
        self.captured_state["comm_bytes"] = dict(counter.sent_bytes)
        self.capture_state = False
        return loss

    def _forward_backward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Check the step's tokens, clear the gradients, run every micro-batch's forward and
        backward (accumulated or pipelined); returns this rank's loss sum."""
        plan = self.plan
        expected = (plan.global_batch // plan.dp, plan.seq_len + 1)
        if tuple(tokens.shape) != expected:
            raise ValueError(f"step() takes tokens of shape {list(expected)} (global_batch / dp, "
                             f"seq_len + 1), got {list(tokens.shape)}")
        tokens = tokens.to(self.device)
        inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        if self.schedule is None:
            return self._accumulate(inputs, labels)
        return self._pipelined(inputs, labels)

    def _step(self, tokens: torch.Tensor) -> float:
        plan = self.plan
        loss_sum = self._forward_backward(tokens)
        if self.capture_state:  # the end of backward, before anything touches the gradients
            self.captured_state = state_line.held_bytes(self)
        self._align_grads()
        self._sync_tied_grads()
        grads = [p.grad for params in self._params for p in params
                 if p.grad is not None]
        if self.scaler is not None:
            loss_sum /= self.scaler.scale
            self.scaler.unscale_(grads)
        self._grad_norm = global_grad_norm([p.grad for p in self._norm_params()],
                                           self.train_mesh)
        if self.scaler is None or self.scaler.update(self._grad_norm):
            if self.optim.grad_clip > 0:
                clip_grads_(grads, self._grad_norm, self.optim.grad_clip)
            for opt in self.optimizers:
                opt.step()
        for sched in self.lr_schedulers:
            sched.step()
        for module in self._fsdp_modules if self.plan.zero == 2 else ():
            module.reshard()  # the next step gathers the updated weights
        # every last-stage rank holds the sum of its m micro-batch means; tp ranks repeat it
        if not self.has_last:
            loss_sum.zero_()
        dist.all_reduce(loss_sum)
        return float(loss_sum) / (plan.num_microbatches * plan.dp * plan.tp)

    def grad_norm_last(self) -> float:
        """The global gradient norm of the last step, before clipping."""
        return self._grad_norm


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def build_engine(model: ModelSpec, plan: Plan, optim: OptimConfig, *, seed: int,
                 device: torch.device) -> TrainEngine:
    """This rank's part of ``plan``: model chunks built from ``seed``, parallelized, with
    optimizers and (pp > 1) the pipeline schedule. torch.distributed must be initialised."""
    if not dist.is_initialized():
        raise RuntimeError("build_engine needs torch.distributed initialised "
                           "(launch with torchrun, or call init_process_group first)")
    validate_plan(model, plan, dist.get_world_size())
    if any(stage.layer_strategies is not None for stage in plan.stages):
        from meshmorph.run.engine.layerwise_engine import LayerwiseEngine

        return LayerwiseEngine(spec=model, plan=plan, optim=optim, seed=seed, device=device)
    mesh = build_mesh(plan, device.type)
    chunk_ids = plan.chunks_of(mesh.pp_rank)
    parts, runners = [], []
    for index in chunk_ids:
        stage = plan.stages[index]
        # built on the meta device; parallelize allocates and fills only this rank's shards
        chunk = build_chunk(model, stage.start, stage.stop, seed=seed, device="meta")
        runners.append(parallelize(chunk, model, plan, stage, mesh, seed=seed, device=device))
        parts.append(chunk)
    return TrainEngine(spec=model, plan=plan, optim=optim, mesh=mesh, model_parts=parts,
                       runners=runners, chunk_ids=chunk_ids, device=device)

