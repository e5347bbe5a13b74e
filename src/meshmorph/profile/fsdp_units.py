"""FSDP2's own work per unit: the all-gather and the gradient reduce-scatter of one
``fully_shard`` unit as the runtime runs them (copy-in, the collective, copy-out, the hooks).

On CPU processes FSDP2's copies into and out of its flat buffers cost more than the collective
the alpha-beta fit of ``all_gather``/``reduce_scatter`` measures (a ZeRO-3 step spent more time
in ``aten::copy_`` and ``aten::cat`` than in the collectives, torch profiler), so the cost model
prices FSDP's calls from these fits where a Profile has them (``fsdp_all_gather/N``,
``fsdp_reduce_scatter/N`` in ``Profile.collectives``; bytes = the unit's unsharded parameters in
the compute dtype, or its unsharded gradients in the reduce dtype, comm.py's M).

Units are 1..k consecutive blocks of the model (``nn.Sequential``), so their tensor count grows
with their bytes as in the model. Per unit size:

- gather: ``unshard()`` + ``reshard()`` (one all-gather and the free);
- reduce-scatter: forward + backward of the unit with gradient sync on, minus the same with it
  off (the compute and the two gathers cancel).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from meshmorph.profile.alpha_beta import fit_alpha_beta
from meshmorph.profile.hardware import DTYPES
from meshmorph.profile.timing import every_rank, median_spread, timed
from meshmorph.run.models import build_chunk
from meshmorph.spec.model import ModelSpec


class FsdpUnits:
    """Units of 1..``max_blocks`` blocks of ``model`` sharded over all ``world`` ranks, each
    size timed once per ``sample()`` (gather; a pass with gradient sync on; one with it off,
    one after the other so that a load change moves both alike); ``fits()`` are the alpha-beta
    lines through the medians."""

    def __init__(self, model: ModelSpec, world: int, device: torch.device, *, dtype: str = "fp32",
                 max_blocks: int = 3, last_arrival: bool = False):
        self.world = world
        self.last_arrival = last_arrival
        """Keep, per sample, the least gather time over the ranks and the pair of passes of the
        rank whose with-sync pass exceeds its without by least (``timing.last_arrival``): the
        rank that waits for no other one."""
        mesh = init_device_mesh(device.type, (world,))
        policy = MixedPrecisionPolicy(param_dtype=DTYPES[dtype], reduce_dtype=torch.float32)
        blocks = min(max_blocks, model.num_blocks // 2)
        first = next(i for i, layer in enumerate(model.layers) if layer.kind == "block")
        self.sizes: list[float] = []
        self.grad_sizes: list[float] = []
        self.calls: list[tuple[Callable[[], None], Callable[[], None], Callable[[], None]]] = []
        for k in range(1, blocks + 1):
            # two units of k blocks under a root without parameters of its own, as the model's
            # blocks run: the first unit's reduce-scatter may overlap the second's backward, as
            # a block's does in the model; the root's per-pass work is not a per-unit cost
            chunk = build_chunk(model, first, first + 2 * k, seed=0, device=device)
            blocks_ = list(chunk.blocks.values())
            units = [nn.Sequential(*blocks_[:k]), nn.Sequential(*blocks_[k:])]
            params = sum(p.numel() for p in units[0].parameters())
            for unit in units:
                fully_shard(unit, mesh=mesh, reshard_after_forward=True, mp_policy=policy)
            root = nn.Sequential(*units)
            fully_shard(root, mesh=mesh, reshard_after_forward=True, mp_policy=policy)
            assert isinstance(units[0], FSDPModule) and isinstance(root, FSDPModule)
            x = torch.randn(1, model.seq_len, model.hidden_size, device=device, requires_grad=True)
            _pass(root, x, True)  # FSDP2's lazy init
            self.calls.append((partial(_gather, units[0]), partial(_pass, root, x, True),
                               partial(_pass, root, x, False)))
            self.sizes.append(float(params * torch.finfo(DTYPES[dtype]).bits // 8))
            self.grad_sizes.append(float(params * 4))
        self.units = len(units)
        self.gather_s: list[list[float]] = [[] for _ in self.calls]
        self.with_sync_s: list[list[float]] = [[] for _ in self.calls]
        self.without_s: list[list[float]] = [[] for _ in self.calls]

    def sample(self, *, keep: bool = True, tick: Callable[[], None] | None = None) -> None:
        """One gather and one pass with and one without gradient sync of every unit size."""
        for (gather, with_sync, without), g, w, wo in zip(
                self.calls, self.gather_s, self.with_sync_s, self.without_s, strict=True):
            times = [timed(fn, warmup=0, repeats=1)[0] for fn in (gather, with_sync, without)]
            if keep and self.last_arrival and dist.get_world_size() > 1:
                ranks = every_rank(times)
                pair = min(ranks, key=lambda r: r[1] - r[2])
                times = [min(r[0] for r in ranks), pair[1], pair[2]]
            if keep:
                g.append(times[0])
                w.append(times[1])
                wo.append(times[2])
            if tick is not None:
                tick()

    def fits(self, window: slice = slice(None)) -> dict[str, dict[str, float]]:
        """``fsdp_all_gather/world`` and ``fsdp_reduce_scatter/world`` -> alpha-beta fits through
        the medians of the kept samples in ``window``."""
        gather = [median_spread(s[window])[0] for s in self.gather_s]
        scatter = [max(median_spread(w[window])[0] - median_spread(wo[window])[0], 0.0) / self.units
                   for w, wo in zip(self.with_sync_s, self.without_s, strict=True)]
        return {f"fsdp_all_gather/{self.world}": fit_alpha_beta(self.sizes, gather).as_dict(),
                f"fsdp_reduce_scatter/{self.world}":
                    fit_alpha_beta(self.grad_sizes, scatter).as_dict()}


def _gather(unit: FSDPModule) -> None:
    unit.unshard()
    unit.reshard()


def _pass(root: FSDPModule, x: torch.Tensor, sync: bool) -> None:
    root.set_requires_gradient_sync(sync)
    root(x).float().sum().backward()  # type: ignore[operator]
    for p in root.parameters():  # type: ignore[attr-defined]
        p.grad = None


def fsdp_unit_fits(model: ModelSpec, world: int, device: torch.device, *, dtype: str = "fp32",
                   repeats: int, max_blocks: int = 3,
                   tick: Callable[[], None] | None = None) -> dict[str, dict[str, float]]:
    """``fsdp_all_gather/world`` and ``fsdp_reduce_scatter/world`` -> alpha-beta fits over units
    of 1..``max_blocks`` blocks of ``model`` sharded over all ``world`` ranks (``FsdpUnits``:
    ``repeats`` samples after one untimed one)."""
    units = FsdpUnits(model, world, device, dtype=dtype, max_blocks=max_blocks)
    units.sample(keep=False)
    for i in range(repeats):
        units.sample(tick=tick if i == repeats - 1 else None)
    dist.barrier()
    return units.fits()
