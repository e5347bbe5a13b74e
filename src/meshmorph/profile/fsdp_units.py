"""FSDP2's own work per unit: the all-gather and the gradient reduce-scatter of one
``fully_shard`` unit, each run directly as FSDP2 runs it, on the real sizes of a unit of the model.

On CPU processes FSDP2's copies into and out of its flat buffers cost more than the collective
the alpha-beta fit of ``all_gather``/``reduce_scatter`` measures (a ZeRO-3 step spent more time
in ``aten::copy_`` and ``aten::cat`` than in the collectives, torch profiler), so the cost model
prices FSDP's calls from these fits where a Profile has them (``fsdp_all_gather/N``,
``fsdp_reduce_scatter/N`` in ``Profile.collectives``; bytes = the unit's unsharded parameters in
the compute dtype, or its unsharded gradients in the reduce dtype, comm.py's M).

Units are 1..k consecutive blocks of the model, ``fully_shard``-ed over the group of all ranks
(the plan's dp group) with the plan's mixed-precision policy, so their tensor count grows with
their bytes as in the model. Per unit size, FSDP2's own code is called directly:

- gather: ``unshard()`` + ``reshard()`` (FSDP2's ``foreach_all_gather``: the shards copied into
  one flat input, ``all_gather_into_tensor``, the copy-out into the unsharded parameters; then
  the free);
- reduce-scatter: with the unit gathered and a gradient on every unsharded parameter (set
  untimed), the unit's ``post_backward`` (FSDP2's ``foreach_reduce``: chunk-cat of the gradients
  in the reduce dtype, ``reduce_scatter_tensor``, the sharded gradients made DTensors, the
  reshard) — what the backward runs after each unit's gradients.

Each is timed several times per sample from a common barrier; with ``last_arrival`` each call
keeps the least time over the ranks (the rank that reached it last: its own time, no wait for
another rank). An earlier version took the reduce-scatter as the difference of a forward and
backward pass with gradient sync on and off, which scattered by +-30% from sample to sample; a
bare collective with its copies (no FSDP2 code around it) came out 20-27% short on FSDP2 plans.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

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
        mesh = init_device_mesh(device.type, (world,))
        param_dtype, grad_dtype = DTYPES[dtype], DTYPES[reduce_dtype]
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=grad_dtype)
        blocks = min(max_blocks, model.num_blocks // 2)
        first = next(i for i, layer in enumerate(model.layers) if layer.kind == "block")
        self.sizes: list[float] = []
        """Bytes each unit's all-gather fills (unsharded parameters in the compute dtype)."""
        self.grad_sizes: list[float] = []
        """Bytes each unit's reduce-scatter reduces (unsharded gradients in the reduce dtype)."""
        self.calls: list[tuple[Callable[[], None], Callable[[], None], Callable[[], None]]] = []
        """Per unit size: (gather, the reduce-scatter's untimed set-up, the reduce-scatter)."""
        for k in range(1, blocks + 1):
            chunk = build_chunk(model, first, first + k, seed=0, device=device)
            unit = nn.Sequential(*chunk.blocks.values())
            numel = sum(p.numel() for p in unit.parameters())
            fully_shard(unit, mesh=mesh, reshard_after_forward=True, mp_policy=policy)
            assert isinstance(unit, FSDPModule)
            x = torch.randn(1, model.seq_len, model.hidden_size, device=device)
            unit(x).float().sum().backward()  # type: ignore[operator]  # FSDP2's lazy init
            for p in unit.parameters():
                p.grad = None
            group = unit._get_fsdp_state()._fsdp_param_group  # noqa: SLF001
            assert group is not None
            self.calls.append((partial(_gather, unit), partial(_grads, unit, group),
                               partial(_post_backward, unit, group)))
            self.sizes.append(float(numel * torch.finfo(param_dtype).bits // 8))
            self.grad_sizes.append(float(numel * torch.finfo(grad_dtype).bits // 8))
        self.gather_s: list[list[float]] = [[] for _ in self.calls]
        self.scatter_s: list[list[float]] = [[] for _ in self.calls]

    def sample(self, *, keep: bool = True, tick: Callable[[], None] | None = None) -> None:
        """``repeats`` gathers, then as many reduce-scatters, of every unit size."""
        times = []
        for gather, setup, scatter in self.calls:
            times.append(timed(gather, warmup=0, repeats=self.repeats))
            row = []
            for _ in range(self.repeats):
                setup()
                row.append(timed(scatter, warmup=0, repeats=1)[0])
            times.append(row)
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


def _gather(unit: FSDPModule) -> None:
    unit.unshard()
    unit.reshard()


def _grads(unit: FSDPModule, group: FSDPParamGroup) -> None:
    """Gather the unit and give every unsharded parameter a gradient, as its backward leaves it."""
    unit.unshard()
    for fsdp_param in group.fsdp_params:
        param = fsdp_param.unsharded_param
        param.grad = torch.full_like(param, 1e-3)


def _post_backward(unit: FSDPModule, group: FSDPParamGroup) -> None:
    """FSDP2's reduce-scatter of the unit's gradients and its reshard; the sharded gradients are
    dropped (the next set-up makes new ones)."""
    group.post_backward()
    for p in unit.parameters():  # type: ignore[attr-defined]
        p.grad = None


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
