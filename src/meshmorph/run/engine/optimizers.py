"""The optimizers of one model chunk: AdamW (fused on CUDA, foreach elsewhere) with its LR
schedule, one per group of the chunk's segments that share a split and a kind of parameter.

A uniform plan's chunk is one segment, so one group and one optimizer: ``ShardedAdamW``
(run/parallel/zero1.py) for ZeRO-1 over dp > 1, else AdamW. A plan whose layers' strategies
differ gets one per (tp degree, kind): foreach kernels and ZeRO-1's shard all-gathers take
parameters of one mesh and one kind (plain tensors or tp DTensors, FSDP2 shards, ZeRO-1).
"""

from __future__ import annotations

from enum import StrEnum

import torch
from torch import nn

from meshmorph.run.config import OptimConfig
from meshmorph.run.parallel.segments import Segment
from meshmorph.run.parallel.zero1 import ShardedAdamW

Optimizers = tuple[list[torch.optim.Optimizer], list[torch.optim.lr_scheduler.LRScheduler]]
"""Optimizers and their LR schedulers, one each."""


class ParamKind(StrEnum):
    """How a segment's parameters are held, which sets the optimizer that steps them."""

    FSDP = "fsdp"  # FSDP2's dim-0 shards (ZeRO 2/3 over dp > 1)
    WHOLE = "whole"  # whole parameters or tensor-parallel DTensors
    ZERO1 = "zero1"  # whole parameters whose optimizer state ZeRO-1 shards over dp


def param_kind(segment: Segment) -> ParamKind:
    """The kind of ``segment``'s parameters."""
    if segment.fsdp:
        return ParamKind.FSDP
    if segment.strategy.zero == 1 and segment.strategy.dp > 1:
        return ParamKind.ZERO1
    return ParamKind.WHOLE


def make_optimizers(segments: list[Segment], optim: OptimConfig,
                    device: torch.device) -> Optimizers:
    """The optimizers over one chunk's ``segments`` (module docstring), in (tp, kind) order."""
    fused = device.type == "cuda"
    kw = dict(lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps,
              weight_decay=optim.weight_decay, foreach=not fused, fused=fused)
    groups: dict[tuple[int, ParamKind], tuple[Segment, list[nn.Parameter]]] = {}
    for segment in segments:
        key = (segment.strategy.tp, param_kind(segment))
        groups.setdefault(key, (segment, []))[1].extend(segment.params)
    optimizers: list[torch.optim.Optimizer] = []
    for (tp, kind), (segment, params) in sorted(groups.items()):
        if not params:
            continue
        if kind == ParamKind.ZERO1:
            optimizers.append(ShardedAdamW(params, dp_mesh=segment.mesh.dp_mesh,
                                           dp_tp_mesh=segment.mesh.mesh if tp > 1 else None,
                                           **kw))  # type: ignore[arg-type]
        else:
            optimizers.append(torch.optim.AdamW(params, **kw))  # type: ignore[arg-type]
    schedulers: list[torch.optim.lr_scheduler.LRScheduler] = [
        torch.optim.lr_scheduler.LambdaLR(opt, lambda step: optim.lr_at(step) / optim.lr)
        for opt in optimizers]
    return optimizers, schedulers
