"""GEMM throughput and collective timings on the local devices (every rank at once)."""

from __future__ import annotations

import statistics
from collections.abc import Iterator

import torch
import torch.distributed as dist

from meshmorph.profile.alpha_beta import fit_alpha_beta
from meshmorph.profile.timing import every_rank, median_spread, timed

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")


def gemm_flops(shapes: list[tuple[int, int, int]], dtypes: list[str], device: torch.device, *,
               repeats: int) -> dict[str, float]:
    """``dtype:MxNxK`` -> achieved FLOP/s (2 M N K per call, median of ``repeats``)."""
    out: dict[str, float] = {}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for dtype in dtypes:
        for m, n, k in shapes:
            a = torch.randn(m, k, device=device).to(DTYPES[dtype])
            b = torch.randn(k, n, device=device).to(DTYPES[dtype])

            def call(a: torch.Tensor = a, b: torch.Tensor = b) -> None:
                torch.mm(a, b)
                sync()

            med, _ = median_spread(timed(call, warmup=1, repeats=repeats))
            out[f"{dtype}:{m}x{n}x{k}"] = 2.0 * m * n * k / med
    return out


def _call(kind: str, group: dist.ProcessGroup, size: int, rank: int, nbytes: int,
          device: torch.device) -> object:
    """A closure running one collective of ``kind`` over ``nbytes`` (comm.py's M)."""
    elems = max(size, nbytes // 4 // size * size)
    if kind == "all_reduce":
        buf = torch.ones(elems, device=device)
        return lambda: dist.all_reduce(buf, group=group)
    if kind == "all_gather":  # M = the gathered buffer
        full, part = torch.empty(elems, device=device), torch.ones(elems // size, device=device)
        return lambda: dist.all_gather_into_tensor(full, part, group=group)
    if kind == "reduce_scatter":  # M = the buffer before scattering
        full, part = torch.ones(elems, device=device), torch.empty(elems // size, device=device)
        return lambda: dist.reduce_scatter_tensor(part, full, group=group)
    buf = torch.ones(elems, device=device)  # send_recv: a ping-pong between ranks 0 and 1, halved
    peer = 1 - rank

    def ping() -> None:
        if rank == 0:
            dist.send(buf, peer)
            dist.recv(buf, peer)
        elif rank == 1:
            dist.recv(buf, peer)
            dist.send(buf, peer)
    return ping


def _collectives(world: int) -> Iterator[tuple[str, dist.ProcessGroup, int]]:
    """(``kind/g``, group, g) of every kind over the first g ranks, g = 2..world (send/recv
    between ranks 0 and 1 only); every rank takes part in creating each group."""
    for size in range(2, world + 1):
        group = dist.new_group(list(range(size)))
        for kind in KINDS:
            if kind != "send_recv" or size == 2:
                yield f"{kind}/{size}", group, size


def collective_fits(sizes_bytes: list[int], world: int, rank: int, device: torch.device, *,
                    repeats: int, tick: object = None) -> dict[str, dict[str, float]]:
    """``kind/group_size`` -> alpha-beta fit, for every kind and every group of the first g
    ranks (g = 2..world); send/recv between ranks 0 and 1."""
    out: dict[str, dict[str, float]] = {}
    for key, group, size in _collectives(world):
        kind, member = key.split("/")[0], rank < size
        ys = []
        for nbytes in sizes_bytes:
            fn = _call(kind, group, size, rank, nbytes, device) if member else (lambda: None)
            med, _ = median_spread(timed(fn, warmup=1, repeats=repeats))  # all ranks in step
            ys.append(med / 2 if kind == "send_recv" else med)
            if callable(tick):
                tick()
        if member:
            out[key] = fit_alpha_beta([float(n) for n in sizes_bytes], ys).as_dict()
    return out


class CollectiveSamples:
    """Every kind of collective over the first g ranks (g = 2..world; send/recv between ranks 0
    and 1) at each of ``sizes_bytes``, one call each per ``sample()`` (every rank at once);
    ``fits(window)`` are the alpha-beta lines through the medians of the samples in ``window``."""

    def __init__(self, sizes_bytes: list[int], world: int, rank: int, device: torch.device, *,
                 last_arrival: bool = False):
        self.sizes = [float(n) for n in sizes_bytes]
        self.last_arrival = last_arrival
        """Keep, per call, the least time over the group's ranks: timed on every rank from a
        common barrier, a collective lasts longest on the rank that reaches it first (it also
        waits for the others); the rank that arrives last sees the collective's own time. The
        waits for a slower rank are priced where they arise, from the slowest rank's compute."""
        self.calls: dict[str, list[object]] = {
            key: [_call(key.split("/")[0], group, size, rank, nbytes, device) if rank < size
                  else (lambda: None) for nbytes in sizes_bytes]
            for key, group, size in _collectives(world)}
        self.members = {key for key in self.calls if rank < int(key.split("/")[1])}
        self.seconds: dict[str, list[list[float]]] = {k: [[] for _ in sizes_bytes] for k in self.calls}

    def sample(self, *, keep: bool = True) -> None:
        times = []
        for key, calls in self.calls.items():
            for fn in calls:
                t = timed(fn, warmup=0, repeats=1)[0]  # type: ignore[arg-type]
                times.append(t / 2 if key.startswith("send_recv") else t)
        if not keep:
            return
        if self.last_arrival and dist.get_world_size() > 1:
            # over the group's members only (the first g ranks of a key ``kind/g``)
            members = [int(key.split("/")[1]) for key, calls in self.calls.items() for _ in calls]
            ranks = every_rank(times)
            times = [min(r[i] for r in ranks[:g]) for i, g in enumerate(members)]
        flat = iter(times)
        for rows in self.seconds.values():
            for out in rows:
                out.append(next(flat))

    def fits(self, window: slice = slice(None)) -> dict[str, dict[str, float]]:
        return {key: fit_alpha_beta(self.sizes, [statistics.median(s[window]) for s in rows]).as_dict()
                for key, rows in self.seconds.items() if key in self.members}
