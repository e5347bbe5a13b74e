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
from meshmorph.profile.timing import every_rank, median_spread, timed, window_median
from meshmorph.run.engine.grad_norm import clip_grads_, local_sums_of_squares
from meshmorph.run.model.decoder import build_chunk
from meshmorph.run.model.loss import token_cross_entropy
from meshmorph.spec.model import ModelSpec


def _autocast(dtype: str, device: torch.device) -> contextlib.AbstractContextManager[object]:
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[dtype])


class LayerPasses:
    """Whole training passes of a model (embedding, blocks, head and the token cross-entropy
    loss) timed layer by layer, one pass per ``sample()``: a clock stamp after each layer's
    forward, and a gradient hook on each layer's output stamps where the backward reaches it.
    ``meshmorph profile`` takes its samples in a row; ``meshmorph validate`` takes them between
    a plan's steps, so that both see the same load."""

    def __init__(self, model: ModelSpec, micro_batch: int, dtype: str, device: torch.device, *,
                 slowest: bool = False):
        self.model, self.micro_batch, self.dtype, self.device = model, micro_batch, dtype, device
        self.slowest = slowest
        """Keep, of each sample, the per-layer times of the rank whose passes took longest
        (every rank then holds the same figures): a step that synchronises its ranks lasts as
        long as its slowest rank's compute, and on shared cores the ranks' shares differ."""
        gen = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, model.vocab_size, (micro_batch, model.seq_len),
                                    generator=gen).to(device)
        self.whole = build_chunk(model, 0, model.num_layers, seed=0, device=device)
        self.layers: list[nn.Module] = [self.whole.embed, *self.whole.blocks.values(),  # type: ignore[list-item]
                                        self.whole.head]
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.fwd: list[list[float]] = [[] for _ in self.layers]
        self.bwd: list[list[float]] = [[] for _ in self.layers]
        self.starts: list[int] = []
        """Index in ``fwd``/``bwd`` where each kept sample's passes begin."""

    def sample(self, *, keep: bool = True, passes: int = 1) -> float:
        """``passes`` passes back to back after one barrier; their per-layer times are kept
        unless ``keep`` is False (warm-up). Returns the seconds of them all. A burst as long as
        a plan's own compute gets the share of the cores the plan's compute gets on a loaded
        machine, where a short pass right after a barrier's wait may run ahead of work that has
        used its share."""
        if dist.is_initialized():
            dist.barrier()  # every process runs the passes at once
        if keep:
            self.starts.append(len(self.fwd[0]))
        first = time.perf_counter()
        for _ in range(passes):
            self._pass(keep)
        seconds = time.perf_counter() - first
        if keep and self.slowest and dist.is_initialized() and dist.get_world_size() > 1:
            start, tables = self.starts[-1], (self.fwd, self.bwd)
            slowest = _slowest_rank([[row[start:] for row in rows] for rows in tables])
            for rows, times in zip(tables, slowest, strict=True):
                for row, slow in zip(rows, times, strict=True):
                    row[start:] = slow
        return seconds

    def _pass(self, keep: bool) -> None:
        layers, sync = self.layers, self.sync
        stamps_f = [time.perf_counter()]
        stamps_b: dict[int, float] = {}
        x: torch.Tensor = self.tokens
        with _autocast(self.dtype, self.device):
            for k, layer in enumerate(layers):
                x = layer(x)
                if k == len(layers) - 1:
                    x = token_cross_entropy(x, self.tokens)
                else:
                    x.register_hook(partial(_stamp, stamps_b, k, sync))
                sync()
                stamps_f.append(time.perf_counter())
        start = time.perf_counter()
        x.backward()
        sync()
        end = time.perf_counter()
        self.whole.zero_grad(set_to_none=True)
        if keep:
            # backward of layer k runs from the gradient's arrival at its output (k) to its
            # arrival at its input (k - 1); the head's starts at backward(), the embedding's
            # ends with it
            arrive = [stamps_b[k] for k in range(len(layers) - 1)]
            for k in range(len(layers)):
                self.fwd[k].append(stamps_f[k + 1] - stamps_f[k])
                t_in = arrive[k - 1] if k > 0 else end
                t_out = arrive[k] if k < len(layers) - 1 else start
                self.bwd[k].append(t_in - t_out)

    def times(self, window: slice = slice(None)) -> dict[str, dict[str, float]]:
        """``layer_key`` -> ``fwd_s``, ``bwd_s`` (medians over the passes of the kept samples in
        ``window``, a slice of sample indices) and ``spread``."""
        bounds = [*self.starts, len(self.fwd[0])]
        rows = [i for n in range(len(self.starts))[window] for i in range(bounds[n], bounds[n + 1])]
        out = {}
        for k in range(len(self.layers)):
            f_med, f_spread = median_spread([self.fwd[k][i] for i in rows])
            b_med, b_spread = median_spread([self.bwd[k][i] for i in rows])
            out[layer_key(self.model.name, self.model.seq_len, self.micro_batch, self.dtype, k)] = {
                "fwd_s": f_med, "bwd_s": b_med, "spread": max(f_spread, b_spread)}
        return out


def _slowest_rank(times: list[list[list[float]]]) -> list[list[list[float]]]:
    """``times`` (a nesting of equal shape on every rank) of the rank whose figures add up to
    the most seconds, gathered over the default group."""
    local = np.asarray(times, dtype=np.float64)
    ranks = every_rank(local.ravel().tolist())
    slowest = max(ranks, key=sum)
    return np.asarray(slowest).reshape(local.shape).tolist()  # type: ignore[no-any-return]


def layer_times(model: ModelSpec, micro_batch: int, dtype: str, device: torch.device, *,
                repeats: int, warmup: int = 2) -> dict[str, dict[str, float]]:
    """``layer_key`` -> ``fwd_s``, ``bwd_s``, ``spread`` for every layer of ``model``: ``repeats``
    whole passes (``LayerPasses``) after ``warmup`` untimed ones."""
    passes = LayerPasses(model, micro_batch, dtype, device)
    for i in range(warmup + repeats):
        passes.sample(keep=i >= warmup)
    return passes.times()


def _stamp(stamps: dict[int, float], k: int, sync: Callable[[], object],
           grad: torch.Tensor) -> None:
    """Gradient hook: the moment the backward reaches layer k's output (first arrival)."""
    sync()
    stamps.setdefault(k, time.perf_counter())


class OptimizerTails:
    """A step's tail (gradient norm, clip, AdamW foreach, LR schedule) over chunks of growing
    size (the second layer; the first half; the whole model), ``repeats`` tails per chunk per
    ``sample()``; ``fit()`` is the line through their medians. With ``shard_over`` > 1 and
    ``zero`` >= 1 each chunk is ``fully_shard``-ed as run/parallel/parallelize.py shards it, so
    AdamW steps DTensor shards and the norm sums their local squares (run/engine/grad_norm.py);
    the counts are then the parameters of one shard."""

    def __init__(self, model: ModelSpec, device: torch.device, *, slowest: bool = False,
                 shard_over: int = 1, zero: int = 0, repeats: int = 1):
        n = model.num_layers
        self.slowest = slowest
        """Keep, of each sample, the tails of the rank whose tails took longest (as
        ``LayerPasses.slowest``)."""
        shard = shard_over if shard_over > 1 and zero >= 1 else 1
        self.repeats = repeats
        """Tails of every chunk per ``sample()`` (the fit takes the median of all kept)."""
        self.counts: list[float] = []
        """Parameters each chunk's tail updates on one rank."""
        self.tails: list[Callable[[], None]] = []
        mesh = None
        if shard > 1:
            from torch.distributed.device_mesh import init_device_mesh
            mesh = init_device_mesh(device.type, (shard,), mesh_dim_names=("dp",))
        for start, stop in sorted({(1, 2), (1, max(2, n // 2)), (0, n)}):
            chunk = build_chunk(model, start, stop, seed=0, device=device)
            numel = float(sum(p.numel() for p in chunk.parameters() if p.requires_grad))
            if mesh is not None:
                from torch.distributed.fsdp import fully_shard
                for block in chunk.blocks.values():
                    fully_shard(block, mesh=mesh, reshard_after_forward=zero == 3)
                fully_shard(chunk, mesh=mesh, reshard_after_forward=zero == 3)
            params = [p for p in chunk.parameters() if p.requires_grad]
            opt = torch.optim.AdamW(params, lr=1e-4, foreach=device.type != "cuda",
                                    fused=device.type == "cuda")
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
            for p in params:
                p.grad = torch.full_like(p, 1e-3)
            self.tails.append(partial(_tail, params, opt, sched))
            self.counts.append(numel / shard)
        self.seconds: list[list[float]] = [[] for _ in self.tails]

    def sample(self, *, keep: bool = True) -> None:
        """``repeats`` tails of every chunk (every rank at once); kept unless ``keep`` is False."""
        times = [timed(tail, warmup=0, repeats=self.repeats) for tail in self.tails]
        if keep and self.slowest and dist.is_initialized() and dist.get_world_size() > 1:
            times = _slowest_rank([times])[0]
        if keep:
            for out, t in zip(self.seconds, times, strict=True):
                out.extend(t)

    def fit(self, window: slice = slice(None)) -> tuple[float, float]:
        """(fixed s, s per parameter), least squares through the chunks' medians of the kept
        samples in ``window``, never below 0."""
        medians = [window_median(s, self.repeats, window) for s in self.seconds]
        slope, intercept = np.polyfit(self.counts, medians, 1)
        return max(float(intercept), 0.0), max(float(slope), 0.0)


def _tail(params: list[nn.Parameter], opt: torch.optim.Optimizer,
          sched: torch.optim.lr_scheduler.LRScheduler) -> None:
    grads = [p.grad for p in params if p.grad is not None]
    # as the engine's global_grad_norm sums the squares of whole (unsharded) gradients
    sums, _ = local_sums_of_squares(grads)
    norm = float(sums.sum().sqrt())
    clip_grads_(grads, norm, 1.0)
    opt.step()
    sched.step()


def optimizer_fit(model: ModelSpec, device: torch.device, *, repeats: int) -> tuple[float, float]:
    """(fixed s, s per parameter) of a step's tail (``OptimizerTails``): ``repeats`` samples
    after two untimed ones."""
    tails = OptimizerTails(model, device)
    for i in range(2 + repeats):
        tails.sample(keep=i >= 2)
    return tails.fit()
