"""FSDP2's own work per unit: the all-gather and the gradient reduce-scatter of one
``fully_shard`` unit, measured where FSDP2 makes them, on the real sizes of a unit of the model.

On CPU processes FSDP2's copies into and out of its flat buffers cost more than the collective
itself (a ZeRO-3 step spent more time in ``aten::copy_`` and ``aten::cat`` than in the
collectives, torch profiler), so the cost model prices FSDP's calls from these fits where a
Profile has them (``fsdp_all_gather/N``, ``fsdp_reduce_scatter/N``; bytes = the unit's unsharded
parameters in the compute dtype, or its unsharded gradients in the reduce dtype, comm.py's M).

Units are k consecutive blocks (k = 1..``max_blocks``), two under a root as a chunk's blocks
are, sharded over all ranks with the plan's mixed precision, recompute and prefetch
(``Plan.fsdp_prefetch``). Each call is the difference of three forward and backward passes of
the plan's micro-batch (0: one sequence of ``PASS_TOKENS`` tokens), back to back, with gradient
sync: the reduce-scatter is half the pass with both units kept gathered (ZeRO-2) less the plain
blocks' pass; the gather a quarter of the pass with both units resharded after forward and
backward (ZeRO-3) less the kept one. With ``last_arrival`` each pass keeps the least time over
the ranks (the last to arrive waits for nobody) before the differences are taken.

Why inside a pass: on gpt-small units on 2 CPU processes, ``post_backward`` called directly took
7.5 ms against 10-12 ms inside a pass (ZeRO-2/3 plans came out 5-22% short); ``unshard`` +
``reshard`` called directly 5 ms against 6 ms per prefetched gather in a six-unit pass (ZeRO-3
16-18% short); a bare collective with its copies 20-27% short; and the difference of
whole-model passes with sync on and off scattered by +-30% from sample to sample.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from meshmorph.profile.alpha_beta import fit_alpha_beta
from meshmorph.profile.hardware import DTYPES
from meshmorph.profile.timing import every_rank, timed, window_median
from meshmorph.run.model.decoder import build_chunk
from meshmorph.run.parallel.recompute import apply_recompute
from meshmorph.spec.model import ModelSpec, Recompute

CALLS_PER_SAMPLE = 3
"""Calls of each unit's gather and reduce-scatter per ``sample()``, each kept."""
PASS_TOKENS = 4
"""Tokens of the one sequence each timed pass runs where no micro-batch is given."""


class FsdpUnits:
    """Pairs of units of 1..``max_blocks`` blocks of ``model`` sharded over all ``world`` ranks:
    each size's gather and reduce-scatter timed ``calls`` times per ``sample()``; ``fits()`` are
    the alpha-beta lines through the medians."""

    def __init__(self, model: ModelSpec, world: int, device: torch.device, *, dtype: str = "fp32",
                 reduce_dtype: str = "fp32", max_blocks: int = 3, last_arrival: bool = False,
                 calls: int = CALLS_PER_SAMPLE, micro_batch: int = 0,
                 recompute: Recompute = Recompute.NONE, prefetch: bool = True):
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
        self.pairs: list[UnitPair] = []
        """Per unit size: the pair of units and the same blocks without FSDP2."""
        for k in range(1, blocks + 1):
            x = torch.randn(micro_batch or 1, model.seq_len if micro_batch else PASS_TOKENS,
                            model.hidden_size, device=device)
            made = []
            for _ in range(2):
                chunk = build_chunk(model, first, first + 2 * k, seed=0, device=device)
                apply_recompute(chunk, first, (recompute,) * (2 * k))
                made.append(list(chunk.blocks.values()))
            # fp32 masters, computed in the policy's dtype (as the runtime's FSDP2 units); the
            # plain blocks hold the compute dtype
            units = [nn.Sequential(*made[0][:k]), nn.Sequential(*made[0][k:])]
            root = nn.Sequential(*units)
            for module in (*units, root):
                fully_shard(module, mesh=mesh, reshard_after_forward=True, mp_policy=policy)
            pair = UnitPair(root, units, nn.Sequential(*made[1]).to(param_dtype), x, prefetch)
            pair.run(pair.root)  # FSDP2's lazy init
            self.pairs.append(pair)
            numel = sum(p.numel() for p in units[0].parameters())
            self.sizes.append(float(numel * torch.finfo(param_dtype).bits // 8))
            self.grad_sizes.append(float(numel * torch.finfo(grad_dtype).bits // 8))
        self.gather_s: list[list[float]] = [[] for _ in self.pairs]
        self.scatter_s: list[list[float]] = [[] for _ in self.pairs]

    def sample(self, *, keep: bool = True, tick: Callable[[], None] | None = None) -> None:
        """``repeats`` calls of every unit size, each three passes back to back: without
        FSDP2, with the units kept gathered, with the units resharded (all with gradient sync)."""
        times = []
        for pair in self.pairs:
            for _ in range(self.repeats):
                times.extend(timed(partial(pair.run, pair.plain), warmup=0, repeats=1))
                for keep_gathered in (True, False):
                    pair.set_up(keep_gathered)
                    times.extend(timed(partial(pair.run, pair.root), warmup=0, repeats=1))
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
                plain, kept, resharded = next(it), next(it), next(it)
                s.append((kept - plain) / 2)  # two units, one reduce-scatter each
                g.append((resharded - kept) / 4)  # two units, a gather each in both passes

    def fits(self, window: slice = slice(None)) -> dict[str, dict[str, float]]:
        """``fsdp_all_gather/world`` and ``fsdp_reduce_scatter/world`` -> alpha-beta fits through
        the medians of the calls of the kept samples in ``window`` (a slice of sample indices)."""
        gather = [window_median(s, self.repeats, window) for s in self.gather_s]
        scatter = [window_median(s, self.repeats, window) for s in self.scatter_s]
        return {f"fsdp_all_gather/{self.world}": fit_alpha_beta(self.sizes, gather).as_dict(),
                f"fsdp_reduce_scatter/{self.world}":
                    fit_alpha_beta(self.grad_sizes, scatter).as_dict()}


class UnitPair:
    """Two FSDP2 units of equal size under a root, as a chunk's blocks run them (the second's
    gather prefetched in forward, the first's in backward where ``prefetch``), and the same
    blocks without FSDP2."""

    def __init__(self, root: nn.Module, units: list[nn.Sequential], plain: nn.Module,
                 x: torch.Tensor, prefetch: bool):
        self.root = root
        self.units = units
        self.plain = plain
        self.inputs = {id(root): x, id(plain): x.to(next(plain.parameters()).dtype)}
        """Each module's input, cast before any clock (FSDP2 casts the root's itself)."""
        first, second = units
        for unit in (root, *units):
            unit.set_requires_gradient_sync(True)  # type: ignore[operator]
        if prefetch:
            first.set_modules_to_forward_prefetch([second])  # type: ignore[operator]
            second.set_modules_to_backward_prefetch([first])  # type: ignore[operator]
        else:
            for unit in units:
                unit.set_modules_to_backward_prefetch([unit])  # type: ignore[operator]

    def set_up(self, keep_gathered: bool) -> None:
        """Untimed: the units gathered and kept (ZeRO-2), or sharded and resharded after forward
        and after backward (ZeRO-3)."""
        for unit in self.units:
            unit.set_reshard_after_forward(not keep_gathered)  # type: ignore[operator]
            unit.set_reshard_after_backward(not keep_gathered)  # type: ignore[operator]
            if keep_gathered:
                unit.unshard()  # type: ignore[operator]
            else:
                unit.reshard()  # type: ignore[operator]

    def run(self, module: nn.Module) -> None:
        """One forward and backward of ``module``; the gradients are dropped."""
        module(self.inputs[id(module)]).float().sum().backward()
        for p in module.parameters():
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
