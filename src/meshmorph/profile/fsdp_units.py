"""FSDP2's own work per unit: the all-gather and the gradient reduce-scatter of one
``fully_shard`` unit, each run directly as FSDP2 runs it, on the real sizes of a unit of the model.

On CPU processes FSDP2's copies into and out of its flat buffers cost more than the collective
the alpha-beta fit of ``all_gather``/``reduce_scatter`` measures (a ZeRO-3 step spent more time
in ``aten::copy_`` and ``aten::cat`` than in the collectives, torch profiler), so the cost model
prices FSDP's calls from these fits where a Profile has them (``fsdp_all_gather/N``,
``fsdp_reduce_scatter/N`` in ``Profile.collectives``; bytes = the unit's unsharded parameters in
the compute dtype, or its unsharded gradients in the reduce dtype, comm.py's M).

Units are 1..k consecutive blocks of the model, ``fully_shard``-ed over the group of all ranks
(the plan's dp group) with the plan's mixed-precision policy and recompute mode, so their tensor
count grows with their bytes as in the model. Per call of each unit size:

- gather: FSDP2's own ``unshard()`` + ``reshard()`` (``foreach_all_gather``: the shards copied
  into one flat input, ``all_gather_into_tensor``, the copy-out into the unsharded parameters;
  then the free);
- reduce-scatter: FSDP2's whole per-micro-batch work in a pass with gradient sync, as a forward
  and backward of the unit with its parameters kept gathered (ZeRO-2) less the same pass of the
  same blocks without FSDP2: its forward and backward hooks, and ``post_backward`` as its
  autograd hook runs it (the chunk-cat of the gradients in the reduce dtype,
  ``reduce_scatter_tensor``, the sharded gradients made DTensors). The passes run the plan's
  micro-batch (``micro_batch``; 0: one sequence of ``PASS_TOKENS`` tokens).

Each is timed from a common barrier; with ``last_arrival`` each timing keeps the least time over
the ranks (the rank that reached it last: its own time, no wait for another rank). An earlier
version timed ``post_backward`` called directly on set-up gradients: 7.5 ms for a one-block
gpt-small unit against 10-12 ms for the same call inside a pass, which left ZeRO-2/3 plans
predicted 5-22% short (and more with more micro-batches, where the difference repeats); a bare
collective with its copies came out 20-27% short; the difference of a full pass with gradient
sync on and off scattered by +-30% from sample to sample; a gather taken as the difference of a
resharding and a kept pass came out 20-40% below the direct call and left ZeRO-3 plans 15-28%
short.
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
from meshmorph.run.recompute import apply_recompute
from meshmorph.spec.model import ModelSpec, Recompute

CALLS_PER_SAMPLE = 3
"""Calls of each unit's gather and reduce-scatter per ``sample()``, each kept."""
PASS_TOKENS = 4
"""Tokens of the one sequence each timed pass runs where no micro-batch is given."""


class FsdpUnits:
    """Units of 1..``max_blocks`` blocks of ``model`` sharded over all ``world`` ranks: each
    size's gather and reduce-scatter timed ``calls`` times per ``sample()``; ``fits()`` are the
    alpha-beta lines through the medians."""

    def __init__(self, model: ModelSpec, world: int, device: torch.device, *, dtype: str = "fp32",
                 reduce_dtype: str = "fp32", max_blocks: int = 3, last_arrival: bool = False,
                 calls: int = CALLS_PER_SAMPLE, micro_batch: int = 0,
                 recompute: Recompute = Recompute.NONE):
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
        self.units: list[tuple[FSDPModule, Callable[[], None], Callable[[], None]]] = []
        """Per unit size: the unit, one timed forward and backward pass of it, and one of the
        same blocks unsharded (no FSDP2)."""
        for k in range(1, blocks + 1):
            x = torch.randn(micro_batch or 1, model.seq_len if micro_batch else PASS_TOKENS,
                            model.hidden_size, device=device)
            made = []
            for _ in range(2):
                chunk = build_chunk(model, first, first + k, seed=0, device=device)
                apply_recompute(chunk, first, (recompute,) * k)
                made.append(nn.Sequential(*chunk.blocks.values()).to(param_dtype))
            unit, plain = made
            numel = sum(p.numel() for p in unit.parameters())
            fully_shard(unit, mesh=mesh, reshard_after_forward=True, mp_policy=policy)
            assert isinstance(unit, FSDPModule)
            unit(x).float().sum().backward()  # type: ignore[operator]  # FSDP2's lazy init
            for p in unit.parameters():
                p.grad = None
            # the timed pass: gradients reduce-scattered, parameters kept gathered (ZeRO-2)
            unit.set_requires_gradient_sync(True)
            unit.set_reshard_after_forward(False)
            unit.set_reshard_after_backward(False)
            self.units.append((unit, partial(_pass, unit, x),
                               partial(_pass, plain, x.to(param_dtype))))
            self.sizes.append(float(numel * torch.finfo(param_dtype).bits // 8))
            self.grad_sizes.append(float(numel * torch.finfo(grad_dtype).bits // 8))
        self.gather_s: list[list[float]] = [[] for _ in self.units]
        self.scatter_s: list[list[float]] = [[] for _ in self.units]

    def sample(self, *, keep: bool = True, tick: Callable[[], None] | None = None) -> None:
        """``repeats`` calls of every unit size, each a gather, a pass without FSDP2 and a pass
        with it, back to back."""
        times = []
        for unit, run, plain in self.units:
            for _ in range(self.repeats):
                unit.reshard()  # untimed: the previous call's pass left the unit gathered
                times.extend(timed(partial(_gather, unit), warmup=0, repeats=1))
                times.extend(timed(plain, warmup=0, repeats=1))
                unit.unshard()  # untimed: the pass keeps its parameters gathered
                times.extend(timed(run, warmup=0, repeats=1))
            if tick is not None:
                tick()
        if not keep:
            return
        if self.last_arrival and dist.get_world_size() > 1:
            ranks = every_rank(times)
            times = [min(r[i] for r in ranks) for i in range(len(times))]
        it = iter(times)
        for g, s in zip(self.gather_s, self.scatter_s, strict=True):
            for _ in range(self.repeats):
                gather, plain, synced = next(it), next(it), next(it)
                s.append(synced - plain)
                g.append(gather)

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


def _pass(unit: nn.Module, x: torch.Tensor) -> None:
    """One forward and backward of ``unit``; the gradients are dropped."""
    unit(x).float().sum().backward()  # type: ignore[operator]
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
