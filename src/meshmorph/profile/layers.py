"""Forward and backward time of each distinct layer of a model, and the optimizer step's tail."""

from __future__ import annotations

import contextlib

import numpy as np
import torch
from torch import nn

from meshmorph.cost.layer_cost import layer_classes
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
    """``layer_key`` -> ``fwd_s``, ``bwd_s``, ``spread`` for every layer of ``model`` (identical
    layers measured once). The embedding takes tokens; the head's forward includes the token
    cross-entropy loss, as a training step runs it."""
    b, s, h = micro_batch, model.seq_len, model.hidden_size
    last = model.num_layers - 1
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.vocab_size, (b, s), generator=gen).to(device)
    measured: dict[int, dict[str, float]] = {}
    out: dict[str, dict[str, float]] = {}
    for index, cls in enumerate(layer_classes(model)):
        if cls not in measured:
            layer = build_chunk(model, cls, cls + 1, seed=0, device=device)
            measured[cls] = _one_layer(layer, cls, last, tokens, (b, s, h), dtype, device,
                                       repeats=repeats, warmup=warmup)
        out[layer_key(model.name, s, micro_batch, dtype, index)] = measured[cls]
    return out


def _one_layer(layer: nn.Module, index: int, last: int, tokens: torch.Tensor,
               shape: tuple[int, int, int], dtype: str, device: torch.device, *,
               repeats: int, warmup: int) -> dict[str, float]:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    held: dict[str, torch.Tensor] = {}

    def forward() -> None:
        x = tokens if index == 0 else torch.randn(shape, device=device, requires_grad=True)
        with _autocast(dtype, device):
            y = layer(x)
            held["out"] = token_cross_entropy(y, tokens) if index == last else y
        sync()

    def backward() -> None:
        out = held.pop("out")
        out.backward(None if out.dim() == 0 else torch.ones_like(out))
        sync()

    fwd, bwd = [], []
    for i in range(warmup + repeats):
        t_f = timed(forward, warmup=0, repeats=1)[0]
        t_b = timed(backward, warmup=0, repeats=1)[0]
        layer.zero_grad(set_to_none=True)
        if i >= warmup:
            fwd.append(t_f)
            bwd.append(t_b)
    f_med, f_spread = median_spread(fwd)
    b_med, b_spread = median_spread(bwd)
    return {"fwd_s": f_med, "bwd_s": b_med, "spread": max(f_spread, b_spread)}


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
