"""Forward and backward time of each distinct layer of a model, and the optimizer step's tail."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from meshmorph.cost.profile import layer_key
from meshmorph.profile.hardware import DTYPES
from meshmorph.profile.timing import median_spread, timed
from meshmorph.run.grad_norm import clip_grads_
from meshmorph.run.loss import token_cross_entropy
from meshmorph.run.models import build_chunk
from meshmorph.spec.model import ModelSpec


def _autocast(dtype: str, device: torch.device) -> contextlib.AbstractContextManager[object]:
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[dtype])


def layer_times(model: ModelSpec, micro_batch: int, dtype: str, device: torch.device, *,
                repeats: int, warmup: int = 2) -> dict[str, dict[str, float]]:
    """``layer_key`` -> ``fwd_s``, ``bwd_s``, ``spread`` for every layer of ``model``, timed
    inside whole training passes of the model (embedding, blocks, head and the token
    cross-entropy loss), so each layer runs with the caches the layers before it left: a clock
    stamp after each layer's forward, and a gradient hook on each layer's output stamps where
    the backward reaches it."""
    b, s = micro_batch, model.seq_len
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.vocab_size, (b, s), generator=gen).to(device)
    whole = build_chunk(model, 0, model.num_layers, seed=0, device=device)
    layers: list[nn.Module] = [whole.embed, *whole.blocks.values(), whole.head]  # type: ignore[list-item]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fwd: list[list[float]] = [[] for _ in layers]
    bwd: list[list[float]] = [[] for _ in layers]
    for i in range(warmup + repeats):
        if dist.is_initialized():
            dist.barrier()  # every process runs the pass at once
        stamps_f = [time.perf_counter()]
        stamps_b: dict[int, float] = {}
        x: torch.Tensor = tokens
        with _autocast(dtype, device):
            for k, layer in enumerate(layers):
                x = layer(x)
                if k == len(layers) - 1:
                    x = token_cross_entropy(x, tokens)
                else:
                    x.register_hook(partial(_stamp, stamps_b, k, sync))
                sync()
                stamps_f.append(time.perf_counter())
        start = time.perf_counter()
        x.backward()
        sync()
        end = time.perf_counter()
        whole.zero_grad(set_to_none=True)
        if i < warmup:
            continue
        # backward of layer k runs from the gradient's arrival at its output (k) to its arrival
        # at its input (k - 1); the head's starts at backward(), the embedding's ends with it
        arrive = [stamps_b[k] for k in range(len(layers) - 1)]
        for k in range(len(layers)):
            fwd[k].append(stamps_f[k + 1] - stamps_f[k])
            t_in = arrive[k - 1] if k > 0 else end
            t_out = arrive[k] if k < len(layers) - 1 else start
            bwd[k].append(t_in - t_out)
    out = {}
    for k in range(len(layers)):
        f_med, f_spread = median_spread(fwd[k])
        b_med, b_spread = median_spread(bwd[k])
        out[layer_key(model.name, s, micro_batch, dtype, k)] = {
            "fwd_s": f_med, "bwd_s": b_med, "spread": max(f_spread, b_spread)}
    return out


def _stamp(stamps: dict[int, float], k: int, sync: Callable[[], object],
           grad: torch.Tensor) -> None:
    """Gradient hook: the moment the backward reaches layer k's output (first arrival)."""
    sync()
    stamps.setdefault(k, time.perf_counter())


def optimizer_fit(model: ModelSpec, device: torch.device, *, repeats: int) -> tuple[float, float]:
    """(fixed s, s per parameter) of a step's tail — gradient norm, clip, AdamW (foreach), LR
    schedule — fitted over chunks of the model of growing size."""
    counts, seconds = [], []
    n = model.num_layers
    for start, stop in sorted({(1, 2), (1, max(2, n // 2)), (0, n)}):
        chunk = build_chunk(model, start, stop, seed=0, device=device)
        params = [p for p in chunk.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-4, foreach=device.type != "cuda",
                                fused=device.type == "cuda")
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)

        for p in params:
            p.grad = torch.full_like(p, 1e-3)

        def tail(params: list[nn.Parameter] = params, opt: torch.optim.Optimizer = opt,
                 sched: torch.optim.lr_scheduler.LRScheduler = sched) -> None:
            grads = [p.grad for p in params if p.grad is not None]
            norm = float(torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(g) for g in grads])))
            clip_grads_(grads, norm, 1.0)
            opt.step()
            sched.step()

        med, _ = median_spread(timed(tail, warmup=2, repeats=repeats))
        counts.append(float(sum(p.numel() for p in params)))
        seconds.append(med)
    slope, intercept = np.polyfit(counts, seconds, 1)
    return max(float(intercept), 0.0), max(float(slope), 0.0)
