"""Timing with repeats: every rank runs the same work at the same moment (contention included)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist


def timed(fn: Callable[[], object], *, warmup: int, repeats: int,
          barrier: bool = True) -> list[float]:
    """Seconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones; with ``barrier``
    every rank starts each call together, so all processes load the cores at once."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        if barrier and dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def median_spread(samples: list[float]) -> tuple[float, float]:
    """(median, relative half inter-quartile range) of timing samples."""
    med = statistics.median(samples)
    if len(samples) < 4 or med <= 0:
        return med, 0.0
    q = statistics.quantiles(samples, n=4)
    return med, (q[2] - q[0]) / 2 / med


def window_median(samples: list[float], calls: int, window: slice) -> float:
    """Median of the timings of the samples in ``window`` (a slice of sample indices), where
    each sample kept ``calls`` timings in a row."""
    picked = range(len(samples) // calls)[window]
    return statistics.median(t for i in picked for t in samples[i * calls:(i + 1) * calls])


def every_rank(values: list[float]) -> list[list[float]]:
    """``values`` of every rank of the default group, in rank order (one all-gather; every rank
    passes as many)."""
    local = torch.tensor(values, dtype=torch.float64)
    out = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(out, local)
    return [t.tolist() for t in out]

