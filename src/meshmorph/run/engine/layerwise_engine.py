"""LayerwiseEngine: one optimizer step of a layerwise plan (``StagePlan.layer_strategies``), with
the numbers of a single device.

One step: this rank's share of the global batch (the plan's tp x dp layout, as for a uniform
plan) is cut into m micro-batches; each runs through the layers on their own layouts
(run/engine/layerwise_model.py). The last layer's rank holds B / dp_h sequences of the B of a stage
micro-batch (dp_h: that layer's dp) and back-propagates its mean token loss divided by m x dp_h,
its exact share of the mean over the global batch; every layer's gradient on a rank is then its
sequences' exact contribution, summed over the layer's dp group (FSDP2's reduce-scatter for
ZeRO 2/3 layers, one all-reduce per ZeRO 0/1 layer after the last micro-batch:
run/engine/layerwise_grads.py). The global norm counts every element once over the mixed layouts,
gradients are clipped and one AdamW per mesh (a ``ShardedAdamW`` over the layer's dp group for
ZeRO-1 layers) steps; ZeRO-2 layers keep their gathered parameters to the end of the step, as in
the uniform engine.

With pp > 1 each rank builds its chunks (one under gpipe, 1f1b and zb; vpp under interleaved,
chunk c on rank c % pp; two in a V under zbv and dualpipev, chunks r and 2 pp - 1 - r), each
chunk's layers under their own strategies on the rank's stage slices of the layouts' meshes,
and torch pipelining runs the micro-batches (run/engine/pipeline.py's ``build_schedule``, as for a
uniform plan): every chunk's output moves back to the data layout (run/engine/layerwise_model.py), the
last chunk's loss is its data-layout block's mean over m x dp, and torch's own 1/m division is
off (it would miss ZeRO-2's sharded gradients, whose gathered copies are registered at the
step's end). Under the schedules that split backward into input- and weight-gradient passes
(zb, zbv, dualpipev), ZeRO-2 layers accumulate over the step and reduce-scatter once after the
last weight pass (run/engine/layerwise_pipeline.py); ZeRO 0/1 layers are reduced after the schedule
anyway, and ZeRO-3 layers are refused there.

Checkpoints: ``part_optimizers`` lists each chunk's optimizers, so run/checkpoint.py saves them
as one state dict keyed by parameter names, which any other plan loads.

Refused here (a clear PlanError before any process group work): ZeRO-3 layers under
zb, zbv or dualpipev, fp16 loss scaling, a tied embedding and head under different tp
or ZeRO, or under ZeRO 2/3 (spec/runnable.py). Sequence parallelism runs
(run/engine/layerwise_model.py), and a tied embedding and head on different pipeline stages keep
two copies whose gradients are summed, as in the uniform engine.
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from meshmorph.run.config import OptimConfig
from meshmorph.run.engine import state_line
from meshmorph.run.engine.layerwise_grads import (
    layerwise_grad_norm,
    reduce_layer_grads,
    tied_head_copy,
)
from meshmorph.run.engine.layerwise_model import LayerwiseRunner
from meshmorph.run.engine.layerwise_pipeline import hold_reduction, reduce_held
from meshmorph.run.engine.pipeline import build_schedule, io_dtypes
from meshmorph.run.engine.train_engine import TrainEngine
from meshmorph.run.model.decoder import build_chunk
from meshmorph.run.model.loss import token_cross_entropy
from meshmorph.run.parallel.layerwise_parallelize import (
    LayerLayouts,
    LayerUnit,
    parallelize_layerwise,
    stage_degrees,
)
from meshmorph.run.parallel.mesh import build_mesh
from meshmorph.run.parallel.parallelize import TORCH_DTYPES
from meshmorph.run.parallel.zero1 import ShardedAdamW
from meshmorph.spec.model import ModelSpec
from meshmorph.spec.plan import Plan
from meshmorph.spec.runnable import (
    RUNNABLE_PIPELINE_SCHEDULES,
    check_layerwise_runnable,
)

PIPELINE_SCHEDULES = RUNNABLE_PIPELINE_SCHEDULES
"""The pipeline schedules a layerwise plan with pp > 1 runs (spec/runnable.py)."""


def is_layerwise(plan: Plan) -> bool:
    """Whether any stage of ``plan`` lists per-layer strategies."""
    return any(stage.layer_strategies is not None for stage in plan.stages)


def validate_layerwise(model: ModelSpec, plan: Plan) -> None:
    """Refuse the layerwise plans this runtime cannot run (module docstring), naming a way out:
    the rule the planner reads too (spec/runnable.py)."""
    check_layerwise_runnable(model, plan)


class LayerwiseEngine(TrainEngine):
    """This rank's layerwise chunk, its optimizers and the step that trains it (pp 1)."""

    def __init__(self, *, spec: ModelSpec, plan: Plan, optim: OptimConfig, seed: int,
                 device: torch.device) -> None:
        self.spec, self.plan, self.optim, self.device = spec, plan, optim, device
        mesh = build_mesh(plan, device.type)
        self.train_mesh, self.mesh = mesh, mesh.mesh
        self.dp_rank, self.dp_size = mesh.dp_rank, mesh.dp  # the trainer's data layout
        self.layouts = LayerLayouts(plan.tp * plan.dp, stage_degrees(plan), device.type,
                                    pp=plan.pp, pp_rank=mesh.pp_rank)
        self.chunk_ids = plan.chunks_of(mesh.pp_rank)
        hidden, logits = io_dtypes(plan)  # the dtypes torch pipelining sends
        chunks: list[nn.Module] = []
        self._runners: list[LayerwiseRunner] = []
        self._chunk_units: list[list[LayerUnit]] = []
        for index in self.chunk_ids:  # every chunk on this pipeline rank's layouts
            stage = plan.stages[index]
            chunk = build_chunk(spec, stage.start, stage.stop, seed=seed, device="meta")
            units = parallelize_layerwise(chunk, spec, plan, stage, self.layouts, seed=seed,
                                          device=device)
            boundary = None
            if plan.pp > 1:  # a stage's output: the hidden state, or the last chunk's logits
                boundary = logits if index == plan.num_chunks - 1 else hidden
            self._runners.append(LayerwiseRunner(chunk, units, self.layouts, plan.tp,
                                                 boundary_dtype=boundary))
            chunks.append(chunk)
            self._chunk_units.append(units)
        self.units: list[LayerUnit] = [u for units in self._chunk_units for u in units]
        self.runner = self._runners[0]
        self.model_parts = chunks
        self._params = [[p for unit in units for p in unit.params]
                        for units in self._chunk_units]
        self.part_optimizers: list[list[torch.optim.Optimizer]] = []
        """The optimizers over each model part, for checkpoints (run/checkpoint.py): each
        chunk's, saved as one state dict keyed by parameter names."""
        self.optimizers: list[torch.optim.Optimizer] = []
        self.lr_schedulers: list[torch.optim.lr_scheduler.LRScheduler] = []
        for units in self._chunk_units:
            optimizers, schedulers = self._make_optimizers(units)
            self.part_optimizers.append(optimizers)
            self.optimizers += optimizers
            self.lr_schedulers += schedulers
        self.has_first = 0 in self.chunk_ids
        self.has_last = plan.num_chunks - 1 in self.chunk_ids
        self.scaler = None
        self.schedule = None
        if plan.pp > 1:
            self.schedule = build_schedule(list(self._runners), self.chunk_ids, spec, plan,
                                           mesh, device, self._stage_loss)
            # the loss carries the 1/m (as without a pipeline): torch's own division runs over
            # the parameters registered at the step's end, which are not ZeRO-2's sharded ones
            self.schedule.scale_grads = False
        # a tied head on the last stage keeps its own copy of the embedding (on rank 0 too
        # under a V); _sync_tied_grads sums the two copies' gradients
        self._tied_local = spec.tied_embeddings and plan.pp > 1 and \
            plan.pp_rank_of_chunk(plan.num_chunks - 1) == 0
        self._tied_group = None if self._tied_local else self._make_tied_group()
        self._grad_norm = float("nan")
        self._autocast = (partial(torch.autocast, device.type, dtype=TORCH_DTYPES[plan.dtype])
                          if plan.dtype != "fp32" else contextlib.nullcontext)
        self._fsdp_modules = [u.module for u in self.units if isinstance(u.module, FSDPModule)]
        self._zero2 = [u.module for u in self.units
                       if u.fsdp and u.strategy.zero == 2 and isinstance(u.module, FSDPModule)]
        self._split_backward = plan.pp > 1 and plan.schedule.split_backward
        """Whether the schedule splits backward into input- and weight-gradient passes: ZeRO-2
        layers then reduce once after the step's last weight pass (run/engine/layerwise_pipeline.py)."""
        self.capture_state = True
        self.captured_state = None
        self.state_written = False

    def _make_optimizers(self, units: list[LayerUnit]
                         ) -> tuple[list[torch.optim.Optimizer],
                                    list[torch.optim.lr_scheduler.LRScheduler]]:
        """One AdamW per group of a chunk's ``units`` sharing a mesh and a kind of parameter
        (plain tensors, tp DTensors, FSDP2 shards); a ShardedAdamW over the dp group of each
        ZeRO-1 layout."""
        optim = self.optim
        kw = dict(lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps,
                  weight_decay=optim.weight_decay)
        fused = self.device.type == "cuda"
        groups: dict[tuple[int, str], list[nn.Parameter]] = {}
        for unit in units:
            kind = "fsdp" if unit.fsdp else "zero1" if unit.reduces_by_hand and \
                unit.strategy.zero == 1 else "whole"
            groups.setdefault((unit.strategy.tp, kind), []).extend(unit.params)
        optimizers: list[torch.optim.Optimizer] = []
        for (tp, kind), params in sorted(groups.items()):
            if not params:
                continue
            if kind == "zero1":
                layout = self.layouts[tp]
                opt: torch.optim.Optimizer = ShardedAdamW(
                    params, dp_mesh=layout.dp_mesh, dp_tp_mesh=layout.mesh if tp > 1 else None,
                    foreach=not fused, fused=fused, **kw)  # type: ignore[arg-type]
            else:
                opt = torch.optim.AdamW(params, foreach=not fused, fused=fused, **kw)  # type: ignore[arg-type]
            optimizers.append(opt)
        schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, lambda s: optim.lr_at(s) / optim.lr)
                      for opt in optimizers]
        return optimizers, schedulers

    def _accumulate(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Gradient accumulation over the layers' layouts; returns this rank's sum of its
        micro-batch mean losses (its last layer's block)."""
        m = self.plan.num_microbatches
        share = m * self.units[-1].strategy.dp  # the loss this rank back-propagates: mean / share
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for module in self._zero2:
            module.set_reshard_after_backward(False)  # gathered once, kept to the step's end
        for x, y in zip(inputs.chunk(m), labels.chunk(m), strict=True):
            with self._autocast():
                loss = token_cross_entropy(self.runner(x), self.runner.labels(y))
            (loss / share).backward()
            total += loss.detach().double()
        return total

    def _stage_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """A pipeline micro-batch's loss as the last stage back-propagates it: its mean over this
        rank's dp block of the data layout, over m x dp, this block's exact share of the mean
        over the global batch (the gradients are sums over each layer's dp group)."""
        return token_cross_entropy(logits, labels) / (self.plan.num_microbatches * self.plan.dp)

    def _pipelined(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One step through torch pipelining; returns this rank's sum of its micro-batch mean
        losses (zero off the last stage)."""
        for module in self._zero2:
            module.set_reshard_after_backward(False)  # gathered once, kept to the step's end
        if self._split_backward:  # reduced once, after every weight-gradient pass
            hold_reduction(self._zero2)
        losses: list[torch.Tensor] = []
        with self._autocast():
            self.schedule.step(*((inputs,) if self.has_first else ()),  # type: ignore[union-attr]
                               target=labels if self.has_last else None,
                               losses=losses if self.has_last else None)
        if self._split_backward:
            reduce_held(self._zero2)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for loss in losses:
            total += loss.detach().double() * (self.plan.num_microbatches * self.plan.dp)
        return total

    def _step(self, tokens: torch.Tensor) -> float:
        plan = self.plan
        loss_sum = self._forward_backward(tokens)
        reduce_layer_grads(self.units, plan.reduce_dtype)
        if self.capture_state:  # the end of backward (its reductions included)
            self.captured_state = state_line.held_bytes(self)
        self._align_grads()
        self._sync_tied_grads()  # on gradients laid out as their parameters
        skip = set().union(*(tied_head_copy(part, self.spec.tied_embeddings)
                             for part in self.model_parts))  # counted as the embedding
        self._grad_norm = layerwise_grad_norm(self.units, self.device, skip=skip)
        if self.optim.grad_clip > 0:
            grads = [p.grad for params in self._params for p in params if p.grad is not None]
            coef = self.optim.grad_clip / (self._grad_norm + 1e-6)
            if coef < 1.0:  # torch's clip_grad_norm_ rule
                torch._foreach_mul_([_local(g) for g in grads], coef)
        for opt in self.optimizers:
            opt.step()
        for sched in self.lr_schedulers:
            sched.step()
        for module in self._zero2:
            module.reshard()  # the next step gathers the updated weights
        # each rank holds the mean of its last layer's block; tp ranks repeat it
        dist.all_reduce(loss_sum)
        return float(loss_sum) / (plan.num_microbatches * plan.dp * plan.tp)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
