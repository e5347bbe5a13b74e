"""FSDP2's own work per unit: the all-gather and the gradient reduce-scatter of one
``fully_shard`` unit, each run directly as FSDP2 runs it, on the real sizes of a unit of the model.

On CPU processes FSDP2's copies into and out of its flat buffers cost more than the collective
the alpha-beta fit of ``all_gather``/``reduce_scatter`` measures (a ZeRO-3 step spent more time
in ``aten::copy_`` and ``aten::cat`` than in the collectives, torch profiler), so the cost model
prices FSDP's calls from these fits where a Profile has them (``fsdp_all_gather/N``,
``fsdp_reduce_scatter/N`` in ``Profile.collectives``; bytes = the unit's unsharded parameters in
the compute dtype, or its unsharded gradients in the reduce dtype, comm.py's M).

Units are 1..k consecutive blocks of the model, so their tensor count grows with their bytes as
in the model. Per unit size, over the group of all ranks (the plan's dp group):

- gather (FSDP2's ``foreach_all_gather`` and its copy-out): every parameter's dim-0 shard (padded
  as FSDP2 pads) copied into one flat input, ``all_gather_into_tensor``, then
  ``split_with_sizes_copy`` into each parameter's unsharded buffer;
- reduce-scatter (FSDP2's ``foreach_reduce``): the unsharded gradients chunk-concatenated in the
  reduce dtype (``torch._chunk_cat``, one chunk per rank), divided by the group size (gloo has no
  average), ``reduce_scatter_tensor``, the shards left as views (as FSDP2 leaves them).

Each is timed several times per sample from a common barrier; with ``last_arrival`` each call
keeps the least time over the ranks (the rank that reached it last: its own time, no wait for
another rank). An earlier version took the reduce-scatter as the difference of a forward and
backward pass with gradient sync on and off, which scattered by +-30% from sample to sample.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from meshmorph.profile.alpha_beta import fit_alpha_beta
from meshmorph.profile.hardware import DTYPES
from meshmorph.profile.timing import every_rank, median_spread, timed
from meshmorph.run.models import build_chunk
from meshmorph.spec.model import ModelSpec

CALLS_PER_SAMPLE = 3
"""Calls of each unit's gather and reduce-scatter per ``sample()``, each kept."""


class FsdpUnits:
    """Units of 1..``max_blocks`` blocks of ``model`` sharded over all ``world`` ranks: each
    size's gather and reduce-scatter timed ``calls`` times per ``sample()``; ``fits()`` are the
    alpha-beta lines through the medians."""

    def __init__(self, model: ModelSpec, world: int, device: torch.device, *, dtype: str = "fp32",
                 reduce_dtype: str = "fp32", max_blocks: int = 3, last_arrival: bool = False,
                 calls: int = CALLS_PER_SAMPLE):
        self.world = world
        self.last_arrival = last_arrival
        """Keep, per call, the least time over the ranks (``CollectiveSamples.last_arrival``)."""
        self.repeats = calls
        group = init_device_mesh(device.type, (world,)).get_group()
        param_dtype, grad_dtype = DTYPES[dtype], DTYPES[reduce_dtype]
        blocks = min(max_blocks, model.num_blocks // 2)
        first = next(i for i, layer in enumerate(model.layers) if layer.kind == "block")
        self.sizes: list[float] = []
        """Bytes each unit's all-gather fills (unsharded parameters in the compute dtype)."""
        self.grad_sizes: list[float] = []
        """Bytes each unit's reduce-scatter reduces (unsharded gradients in the reduce dtype)."""
        self.calls: list[tuple[Callable[[], None], Callable[[], None]]] = []
        for k in range(1, blocks + 1):
            chunk = build_chunk(model, first, first + k, seed=0, device=device)
            params = [p.detach() for p in chunk.parameters()]
            self.calls.append((_gather_call(params, world, group, param_dtype),
                               _scatter_call(params, world, group, grad_dtype)))
            numel = sum(p.numel() for p in params)
            self.sizes.append(float(numel * torch.finfo(param_dtype).bits // 8))
            self.grad_sizes.append(float(numel * torch.finfo(grad_dtype).bits // 8))
        self.gather_s: list[list[float]] = [[] for _ in self.calls]
        self.scatter_s: list[list[float]] = [[] for _ in self.calls]

    def sample(self, *, keep: bool = True, tick: Callable[[], None] | None = None) -> None:
        """``repeats`` gathers, then as many reduce-scatters, of every unit size."""
        times = []
        for gather, scatter in self.calls:
            times.append(timed(gather, warmup=0, repeats=self.repeats))
            times.append(timed(scatter, warmup=0, repeats=self.repeats))
            if tick is not None:
                tick()
        if not keep:
            return
        flat = [t for row in times for t in row]
        if self.last_arrival and dist.get_world_size() > 1:
            ranks = every_rank(flat)
            flat = [min(r[i] for r in ranks) for i in range(len(flat))]
        it = iter(flat)
        for g, s in zip(self.gather_s, self.scatter_s, strict=True):
            g.extend(next(it) for _ in range(self.repeats))
            s.extend(next(it) for _ in range(self.repeats))

    def fits(self, window: slice = slice(None)) -> dict[str, dict[str, float]]:
        """``fsdp_all_gather/world`` and ``fsdp_reduce_scatter/world`` -> alpha-beta fits through
        the medians of the calls of the kept samples in ``window`` (a slice of sample indices)."""
        def rows(samples: list[float]) -> list[float]:
            n = self.repeats
            picked = range(len(samples) // n)[window]
            return [t for i in picked for t in samples[i * n:(i + 1) * n]]
        gather = [median_spread(rows(s))[0] for s in self.gather_s]
        scatter = [median_spread(rows(s))[0] for s in self.scatter_s]
        return {f"fsdp_all_gather/{self.world}": fit_alpha_beta(self.sizes, gather).as_dict(),
                f"fsdp_reduce_scatter/{self.world}":
                    fit_alpha_beta(self.grad_sizes, scatter).as_dict()}


def _padded_rows(p: torch.Tensor, world: int) -> int:
    """Dim-0 rows of ``p`` padded to a multiple of ``world`` (FSDP2's Shard(0) padding)."""
    rows = p.shape[0] if p.dim() > 0 else 1
    return -(-rows // world) * world


def _gather_call(params: list[torch.Tensor], world: int, group: dist.ProcessGroup,
                 dtype: torch.dtype) -> Callable[[], None]:
    """FSDP2's all-gather of one unit: copy-in of this rank's shards, the collective, copy-out."""
    shards = []
    for p in params:
        rows = _padded_rows(p, world) // world
        shards.append(torch.ones(rows, *p.shape[1:], dtype=dtype, device=p.device))
    split = [s.numel() for s in shards]
    flat_in = torch.empty(sum(split), dtype=dtype, device=params[0].device)
    flat_out = torch.empty(world * sum(split), dtype=dtype, device=params[0].device)
    unsharded = [torch.empty(world, n, dtype=dtype, device=params[0].device) for n in split]

    def call() -> None:
        torch.cat([s.view(-1) for s in shards], out=flat_in)
        dist.all_gather_into_tensor(flat_out, flat_in, group=group)
        torch.split_with_sizes_copy(flat_out.view(world, -1), split, dim=1, out=unsharded)
    return call


def _scatter_call(params: list[torch.Tensor], world: int, group: dist.ProcessGroup,
                  dtype: torch.dtype) -> Callable[[], None]:
    """FSDP2's reduce-scatter of one unit's gradients: chunk-cat, pre-divide, the collective."""
    grads = [torch.full_like(p, 1e-3) for p in params]
    padded = sum(_padded_rows(p, world) * (p[0].numel() if p.dim() > 0 else 1) for p in params)
    flat_in = torch.empty(padded, dtype=dtype, device=params[0].device)
    flat_out = torch.empty(padded // world, dtype=dtype, device=params[0].device)

    def call() -> None:
        torch._chunk_cat(grads, dim=0, num_chunks=world, out=flat_in.view(world, -1))
        flat_in.div_(world)
        dist.reduce_scatter_tensor(flat_out, flat_in, group=group)
    return call


def fsdp_unit_fits(model: ModelSpec, world: int, device: torch.device, *, dtype: str = "fp32",
                   repeats: int, max_blocks: int = 3,
                   tick: Callable[[], None] | None = None) -> dict[str, dict[str, float]]:
    """``fsdp_all_gather/world`` and ``fsdp_reduce_scatter/world`` -> alpha-beta fits over units
    of 1..``max_blocks`` blocks of ``model`` sharded over all ``world`` ranks (``FsdpUnits``:
    ``repeats`` calls of each after one untimed sample)."""
    units = FsdpUnits(model, world, device, dtype=dtype, max_blocks=max_blocks, calls=repeats)
    units.sample(keep=False)
    units.sample(tick=tick)
    dist.barrier()
    return units.fits()
