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

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from meshmorph.profile.alpha_beta import fit_alpha_beta
from meshmorph.profile.hardware import DTYPES
from meshmorph.profile.timing import median_spread, timed
from meshmorph.run.models import build_chunk
from meshmorph.spec.model import ModelSpec


def fsdp_unit_fits(model: ModelSpec, world: int, device: torch.device, *, dtype: str = "fp32",
                   repeats: int, max_blocks: int = 3,
                   tick: Callable[[], None] | None = None) -> dict[str, dict[str, float]]:
    """``fsdp_all_gather/world`` and ``fsdp_reduce_scatter/world`` -> alpha-beta fits over units
    of 1..``max_blocks`` blocks of ``model`` sharded over all ``world`` ranks."""
    mesh = init_device_mesh(device.type, (world,))
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[dtype], reduce_dtype=torch.float32)
    blocks = min(max_blocks, model.num_blocks // 2)
    first = next(i for i, layer in enumerate(model.layers) if layer.kind == "block")
    sizes, gather_s, scatter_s, grad_sizes = [], [], [], []
    for k in range(1, blocks + 1):
        # two units of k blocks under a root without parameters of its own, as the model's
        # blocks run: the first unit's reduce-scatter may overlap the second's backward, as a
        # block's does in the model; the root's per-pass work is not a per-unit cost
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

        def gather(unit: FSDPModule = units[0]) -> None:
            unit.unshard()
            unit.reshard()

        def pass_(sync: bool, root: FSDPModule = root, x: torch.Tensor = x) -> None:
            root.set_requires_gradient_sync(sync)
            root(x).float().sum().backward()  # type: ignore[operator]
            for p in root.parameters():  # type: ignore[attr-defined]
                p.grad = None

        pass_(True)  # FSDP2's lazy init
        g, _ = median_spread(timed(gather, warmup=1, repeats=repeats))
        # interleave the two passes so that a load change moves both alike
        with_sync, without = [], []
        for _ in range(repeats):
            with_sync += timed(lambda: pass_(True), warmup=0, repeats=1)
            without += timed(lambda: pass_(False), warmup=0, repeats=1)
        rs = max(median_spread(with_sync)[0] - median_spread(without)[0], 0.0) / len(units)
        sizes.append(float(params * torch.finfo(DTYPES[dtype]).bits // 8))
        grad_sizes.append(float(params * 4))
        gather_s.append(g)
        scatter_s.append(rs)
        del units, root, chunk
        if tick is not None:
            tick()
    dist.barrier()
    return {f"fsdp_all_gather/{world}": fit_alpha_beta(sizes, gather_s).as_dict(),
            f"fsdp_reduce_scatter/{world}": fit_alpha_beta(grad_sizes, scatter_s).as_dict()}
