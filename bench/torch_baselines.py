"""Hand-written torch training steps, one per parallelism family, for bench/run_overhead.py.

Each is what an engineer would write with torch alone for the same model, data and arithmetic as
meshmorph's engine (micro-batch accumulation with the loss scaled by 1/m, the global gradient
norm clipped, AdamW, LambdaLR, the global mean loss all-reduced): DDP, ZeRO-1 as Megatron-LM's
distributed optimizer on FSDP2, FSDP2 ZeRO-3 per block,
tensor parallelism with DTensor (Megatron's split by parallelize_module), and a 1F1B pipeline with
torch.distributed.pipelining. Each factory returns ``step(tokens) -> loss`` for this rank's share
of the global batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshmorph.run.config import OptimConfig
from meshmorph.run.model.decoder import build_chunk, build_model
from meshmorph.run.model.loss import token_cross_entropy
from meshmorph.spec.model import ModelSpec

Step = Callable[[torch.Tensor], float]


def _optimizer(params: Any, optim: OptimConfig) -> tuple[torch.optim.Optimizer, Any]:
    opt = torch.optim.AdamW(params, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps,
                            weight_decay=optim.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: optim.lr_at(s) / optim.lr)
    return opt, sched


def _accumulate(model: nn.Module, tokens: torch.Tensor, m: int,
                no_sync: Callable[[int], Any]) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float64)
    for i, mb in enumerate(tokens.chunk(m)):
        with no_sync(i):
            loss = token_cross_entropy(model(mb[:, :-1]), mb[:, 1:])
            (loss / m).backward()
        total += loss.detach().double()
    return total


def _data_parallel_step(model: nn.Module, optim: OptimConfig, m: int,
                        no_sync: Callable[[int], Any]) -> Step:
    """Accumulate, clip with torch's clip_grad_norm_, step, and return the global mean loss."""
    opt, sched = _optimizer(model.parameters(), optim)

    def step(tokens: torch.Tensor) -> float:
        opt.zero_grad(set_to_none=True)
        total = _accumulate(model, tokens, m, no_sync)
        torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip)
        opt.step()
        sched.step()
        dist.all_reduce(total)
        return float(total) / (m * dist.get_world_size())

    return step


def ddp_step(spec: ModelSpec, optim: OptimConfig, m: int, seed: int) -> Step:
    """DistributedDataParallel over every rank."""
    from contextlib import nullcontext

    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(build_model(spec, seed=seed))
    return _data_parallel_step(model, optim, m,
                               lambda i: model.no_sync() if i < m - 1 else nullcontext())


def zero1_step(spec: ModelSpec, optim: OptimConfig, m: int, seed: int) -> Step:
    """ZeRO-1 as Megatron-LM's distributed optimizer, written with FSDP2 the plain way: every
    block and the root ``fully_shard``-ed without resharding after forward, gradient sync only in
    the last micro-batch (one reduce-scatter per unit per step), AdamW on the shards. (FSDP2
    reshards after each backward here, so each micro-batch's forward gathers again; meshmorph
    keeps the gathered parameters to the step's end.)"""
    from contextlib import contextmanager

    from torch.distributed.fsdp import fully_shard

    model = build_model(spec, seed=seed)
    for unit in [*model.blocks.values(), model]:
        fully_shard(unit, reshard_after_forward=False)

    @contextmanager
    def sync(i: int):  # type: ignore[no-untyped-def]  # noqa: ANN202
        model.set_requires_gradient_sync(i == m - 1)  # type: ignore[operator]
        yield

    return _data_parallel_step(model, optim, m, sync)


def fsdp_step(spec: ModelSpec, optim: OptimConfig, m: int, seed: int) -> Step:
    """FSDP2 fully_shard on every block and the root (ZeRO-3), gradients reduced per micro-batch."""
    from contextlib import nullcontext

    from torch.distributed.fsdp import fully_shard

    model = build_model(spec, seed=seed)
    for block in model.blocks.values():
        fully_shard(block)
    fully_shard(model)
    return _data_parallel_step(model, optim, m, lambda i: nullcontext())


def tp_step(spec: ModelSpec, optim: OptimConfig, m: int, seed: int) -> Step:
    """Tensor parallelism over every rank: q/k/v and fc1 by columns, wo and fc2 by rows, the
    embedding and head by vocabulary; norms stay plain (replicated) tensors. The logits stay
    sharded on the vocabulary and the loss runs under torch's ``loss_parallel`` (the pattern of
    torch's tensor-parallel tutorial)."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        loss_parallel,
        parallelize_module,
    )

    model = build_model(spec, seed=seed)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    plan: dict[str, Any] = {
        "embed.tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "head.out": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    for key in model.blocks:
        for name in ("wq", "wk", "wv"):
            plan[f"blocks.{key}.attn.{name}"] = ColwiseParallel()
        plan[f"blocks.{key}.attn.wo"] = RowwiseParallel()
        plan[f"blocks.{key}.mlp.fc1"] = ColwiseParallel()
        plan[f"blocks.{key}.mlp.fc2"] = RowwiseParallel()
    parallelize_module(model, mesh, plan, src_data_rank=None)
    if spec.tied_embeddings:
        model.head.out.weight = model.embed.tok.weight
    opt, sched = _optimizer(model.parameters(), optim)
    params = list(model.parameters())

    def step(tokens: torch.Tensor) -> float:
        opt.zero_grad(set_to_none=True)
        total = torch.zeros((), dtype=torch.float64)
        for mb in tokens.chunk(m):
            with loss_parallel():
                logits = model(mb[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1).float(), mb[:, 1:].flatten())
                (loss / m).backward()
            total += loss.to_local().detach().double()
        squares = torch.zeros((), dtype=torch.float64)
        for p in params:
            g = p.grad
            if isinstance(g, DTensor):
                g = g.full_tensor()
            squares += g.double().pow(2).sum()
        coef = min(1.0, optim.grad_clip / (float(squares.sqrt()) + 1e-6))
        for p in params:
            p.grad.mul_(coef)
        opt.step()
        sched.step()
        return float(total) / m  # every rank computed the same loss

    return step


def pp_step(spec: ModelSpec, optim: OptimConfig, m: int, seed: int, micro_batch: int) -> Step:
    """Two-stage 1F1B pipeline (torch.distributed.pipelining), the blocks split evenly."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    rank, world = dist.get_rank(), dist.get_world_size()
    blocks = spec.num_layers - 2
    cut = 1 + (blocks + 1) // 2  # layer index where stage 1 starts
    start, stop = (0, cut) if rank == 0 else (cut, spec.num_layers)
    chunk = build_chunk(spec, start, stop, seed=seed)
    s, h = spec.seq_len, spec.hidden_size
    hidden = torch.empty(micro_batch, s, h, device="meta", requires_grad=True)
    inputs = torch.empty(micro_batch, s, dtype=torch.long, device="meta") if rank == 0 else hidden
    outputs = hidden if rank == 0 else torch.empty(micro_batch, s, spec.vocab_size, device="meta",
                                                   requires_grad=True)
    stage = PipelineStage(chunk, rank, world, torch.device("cpu"), input_args=inputs,
                          output_args=outputs)
    schedule = Schedule1F1B(stage, m, loss_fn=token_cross_entropy)
    opt, sched = _optimizer(chunk.parameters(), optim)
    tied = spec.tied_embeddings

    def step(tokens: torch.Tensor) -> float:
        opt.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(tokens[:, :-1].contiguous())
        else:
            schedule.step(target=tokens[:, 1:].contiguous(), losses=losses)
        if tied:  # the embedding on rank 0 and its head copy on rank 1 share one gradient
            weight = chunk.embed.tok.weight if rank == 0 else chunk.head.out.weight
            dist.all_reduce(weight.grad)
        squares = sum((p.grad.double().pow(2).sum() for p in chunk.parameters()
                       if p.grad is not None and not (tied and rank == 1 and p is chunk.head.out.weight)),
                      torch.zeros((), dtype=torch.float64))
        dist.all_reduce(squares)
        coef = min(1.0, optim.grad_clip / (float(squares.sqrt()) + 1e-6))
        for p in chunk.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)
        opt.step()
        sched.step()
        total = torch.stack([x.detach().double() for x in losses]).sum() if losses \
            else torch.zeros((), dtype=torch.float64)
        dist.all_reduce(total)
        return float(total) / m

    return step
