"""Per-tensor costs of building, sharding, filling and reading an engine, measured on a probe.

The probe is one decoder block of the job's model (``run/model/decoder.build_chunk`` on the meta
device, as a move's new engine is built). It is never a plan's engine: the figures are
primitives that ``move_time`` multiplies by a plan's counts (``build_counts``). Local to this
process: the meshes are over the default group (every process calls this under it), and
sharding on the meta device moves no data.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from meshmorph.elastic.live.local_state import local_box
from meshmorph.run.model.decoder import build_chunk
from meshmorph.run.model.materialize import materialize_, state_installed_after
from meshmorph.run.parallel.parallelize import apply_tp
from meshmorph.spec.model import LayerKind, ModelSpec


def timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn()`` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _first_block(model: ModelSpec) -> int:
    return next(i for i, layer in enumerate(model.layers) if layer.kind == LayerKind.BLOCK)


def _chunk(model: ModelSpec, blocks: int) -> nn.Module:
    """The model's first ``blocks`` decoder blocks as a chunk on the meta device."""
    first = _first_block(model)
    return build_chunk(model, first, first + blocks, seed=0, device="meta")


def _units(chunk: nn.Module) -> list[nn.Module]:
    """What FSDP2 shards of a chunk: each block, then the chunk."""
    return [*chunk.blocks.values(), chunk]  # type: ignore[operator]


def _storage(module: nn.Module, model: ModelSpec) -> None:
    """Storage given to a chunk and filled, as a move's new engine gets it."""
    with state_installed_after():
        materialize_(module, model, seed=0, device="cpu")


def _reads(module: nn.Module) -> float:
    """Seconds to take every local box of a chunk's state dict (views: nothing copied)."""
    return timed(lambda: [local_box(v) for v in get_model_state_dict(module).values()])


def _sharding(model: ModelSpec, mesh: DeviceMesh, tensors: int) -> tuple[nn.Module, float, float]:
    """(a chunk sharded as apply_dp shards it, seconds per extra FSDP2 unit, per tensor)."""
    sharded = _chunk(model, 1)
    units = _units(sharded)
    many_s = timed(lambda: [fully_shard(u, mesh=mesh) for u in units])
    one = _chunk(model, 1)
    one_s = timed(lambda: fully_shard(one, mesh=mesh))
    unit = max((many_s - one_s) / max(len(units) - 1, 1), 0.0)
    return sharded, unit, max(one_s - unit, 0.0) / tensors


def _read_costs(model: ModelSpec, sharded: nn.Module, mesh: DeviceMesh,
                tensors: int) -> tuple[float, float]:
    """(seconds per state-dict call, per tensor): the one-block chunk against two blocks."""
    read = _reads(sharded)
    first = _first_block(model)
    if first + 1 >= len(model.layers) or model.layers[first + 1].kind != LayerKind.BLOCK:
        return 0.0, read / tensors
    double = _chunk(model, 2)
    for part in _units(double):
        fully_shard(part, mesh=mesh)
    n2 = sum(1 for _ in double.parameters())
    per_read = max((_reads(double) - read) / max(n2 - tensors, 1), 0.0)
    return max(read - tensors * per_read, 0.0), per_read


def _fill_s(module: nn.Module, model: ModelSpec, nbytes: float, zero_bps: float) -> float:
    """Seconds to give ``module`` storage, less what zeroing its bytes alone takes."""
    seconds = timed(lambda: _storage(module, model))
    return max(seconds - (nbytes / zero_bps if zero_bps > 0 else 0.0), 0.0)


def _once(model: ModelSpec, zero_bps: float) -> dict[str, float]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    world = mesh.size()
    built: list[nn.Module] = []
    meta = timed(lambda: built.append(_chunk(model, 1)))
    tensors = sum(1 for _ in built[0].parameters())
    tp_s = tp_tensors = 0.0
    if model.num_heads % world == 0 and model.num_kv_heads % world == 0 \
            and model.ffn_hidden_size % world == 0:
        tp_chunk = _chunk(model, 1)
        tp_s = timed(lambda: apply_tp(tp_chunk, model, mesh, False))  # type: ignore[arg-type]
        tp_tensors = sum(isinstance(p, DTensor) for p in tp_chunk.parameters())
    sharded, unit, fsdp_tensor_s = _sharding(model, mesh, tensors)
    nbytes = sum(p._local_tensor.numel() * 4 for p in sharded.parameters())  # type: ignore[attr-defined]
    fill_s = _fill_s(sharded, model, nbytes, zero_bps)
    call_s, per_read = _read_costs(model, sharded, mesh, tensors)
    plain = _chunk(model, 1)  # the same without sharding: a DDP or pipeline-only rank's tensors
    plain_fill_s = _fill_s(plain, model, sum(p.numel() * 4 for p in plain.parameters()), zero_bps)
    plain_read = _reads(plain)

    def install() -> None:
        for p in sharded.parameters():
            local_box(p)
            for _ in range(2):
                local_box(torch.empty_like(p))

    install_s = timed(install)
    return {"meta_tensor_s": meta / tensors, "tp_tensor_s": tp_s / max(tp_tensors, 1),
            "fsdp_unit_s": unit, "fsdp_tensor_s": fsdp_tensor_s,
            "materialize_tensor_s": fill_s / tensors, "state_tensor_s": per_read,
            "plain_materialize_tensor_s": plain_fill_s / tensors,
            "plain_state_tensor_s": max(plain_read - call_s, 0.0) / tensors,
            "state_call_s": call_s,
            "install_tensor_s": install_s / tensors}


def probe_costs(model: ModelSpec, *, zero_bps: float = 0.0, repeats: int = 3) -> dict[str, float]:
    """Median per-tensor (and per-unit) seconds over ``repeats`` probes after one warm-up, by
    ``MoveTimeModel`` field name (torch.distributed must be initialised); ``zero_bps``: the
    measured rate of allocating and zeroing fresh memory, taken out of the storage figure."""
    _once(model, zero_bps)  # warm-up: torch's first sharding of a kind fills its caches
    runs = [_once(model, zero_bps) for _ in range(repeats)]
    return {name: statistics.median(run[name] for run in runs) for name in runs[0]}
