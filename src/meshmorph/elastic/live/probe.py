"""Per-tensor costs of building, sharding, filling and reading an engine, measured on a probe.

The probe is one decoder block of the job's model (``run/model/decoder.build_chunk`` on the meta
device, as a move's new engine is built), or without a model ``PROBE_BLOCKS`` blocks of a
linear layer, a norm and a linear layer, ``PROBE_WIDTH`` wide. It is never a plan's engine: the
figures are primitives that ``move_time`` multiplies by a plan's counts (``build_counts``).
Local to this process: the meshes are over the default group (every process calls this under
it), and sharding on the meta device moves no data.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from meshmorph.elastic.live.local_state import local_box
from meshmorph.run.model.decoder import build_chunk
from meshmorph.run.model.materialize import materialize_, state_installed_after
from meshmorph.run.parallel.parallelize import apply_tp
from meshmorph.spec.model import LayerKind, ModelSpec

PROBE_BLOCKS = 4
"""Blocks of the model-less probe."""
PROBE_WIDTH = 64
"""Width of its layers (small: the per-tensor overhead is what is measured, not bytes)."""


def _plain_blocks() -> nn.Sequential:
    with torch.device("meta"):
        return nn.Sequential(*(nn.Sequential(nn.Linear(PROBE_WIDTH, PROBE_WIDTH),
                                             nn.LayerNorm(PROBE_WIDTH),
                                             nn.Linear(PROBE_WIDTH, PROBE_WIDTH))
                               for _ in range(PROBE_BLOCKS)))


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _decoder_layer(model: ModelSpec) -> int:
    return next(i for i, layer in enumerate(model.layers) if layer.kind == LayerKind.BLOCK)


@dataclass(frozen=True, slots=True)
class ProbeSubject:
    """What a probe builds, shards and fills: one block of the job's model, or plain blocks."""

    fresh: Callable[[], nn.Module]
    """A new chunk on the meta device."""
    two_blocks: Callable[[], nn.Module] | None
    """A chunk of two blocks (per-tensor against per-call read costs); None: not measured."""
    tp_style: Callable[[nn.Module], None]
    """Tensor parallelism applied to a chunk."""
    blocks: Callable[[nn.Module], list[nn.Module]]
    """The chunk's blocks (FSDP2 units, then the chunk itself)."""
    storage: Callable[[nn.Module], None]
    """Storage given to a sharded chunk and filled."""
    storage_plain: Callable[[nn.Module], None]
    """The same for a chunk of plain tensors."""
    tp_divides: bool
    """Whether the world's size divides the heads and the FFN (else no TP figure)."""


def _model_subject(model: ModelSpec, mesh: DeviceMesh) -> ProbeSubject:
    layer = _decoder_layer(model)
    world = mesh.size()

    def chunk(blocks: int) -> nn.Module:
        return build_chunk(model, layer, layer + blocks, seed=0, device="meta")

    def storage(module: nn.Module) -> None:
        with state_installed_after():
            materialize_(module, model, seed=0, device="cpu")

    second = layer + 1 < len(model.layers) and model.layers[layer + 1].kind == LayerKind.BLOCK
    return ProbeSubject(
        fresh=lambda: chunk(1), two_blocks=(lambda: chunk(2)) if second else None,
        tp_style=lambda module: apply_tp(module, model, mesh, False),  # type: ignore[arg-type]
        blocks=lambda module: list(module.blocks.values()),  # type: ignore[operator]
        storage=storage, storage_plain=storage,
        tp_divides=model.num_heads % world == 0 and model.num_kv_heads % world == 0
        and model.ffn_hidden_size % world == 0)


def _zero_filled(module: nn.Module, local: bool) -> None:
    module.to_empty(device="cpu")
    with torch.no_grad():
        for p in module.parameters():
            (p._local_tensor if local else p).zero_()  # type: ignore[attr-defined]


def _plain_subject(mesh: DeviceMesh) -> ProbeSubject:
    def tp_style(module: nn.Module) -> None:
        for block in module:
            parallelize_module(block, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})

    return ProbeSubject(fresh=_plain_blocks, two_blocks=None, tp_style=tp_style,
                        blocks=lambda module: list(module),
                        storage=lambda module: _zero_filled(module, True),
                        storage_plain=lambda module: _zero_filled(module, False), tp_divides=True)


def _reads(module: nn.Module) -> float:
    """Seconds to take every local box of a chunk's state dict (views: nothing copied)."""
    return _timed(lambda: [local_box(v) for v in get_model_state_dict(module).values()])


def _sharding(subject: ProbeSubject, mesh: DeviceMesh, tensors: int) -> tuple[nn.Module, float,
                                                                               float]:
    """(a chunk sharded as apply_dp shards it, seconds per extra FSDP2 unit, per tensor)."""
    sharded = subject.fresh()
    units = [*subject.blocks(sharded), sharded]
    many_s = _timed(lambda: [fully_shard(u, mesh=mesh) for u in units])
    one = subject.fresh()
    one_s = _timed(lambda: fully_shard(one, mesh=mesh))
    unit = max((many_s - one_s) / max(len(units) - 1, 1), 0.0)
    return sharded, unit, max(one_s - unit, 0.0) / tensors


def _read_costs(subject: ProbeSubject, sharded: nn.Module, mesh: DeviceMesh,
                tensors: int) -> tuple[float, float]:
    """(seconds per state-dict call, per tensor): the one-block chunk against two blocks."""
    read = _reads(sharded)
    if subject.two_blocks is None:
        return 0.0, read / tensors
    double = subject.two_blocks()
    for part in [*subject.blocks(double), double]:
        fully_shard(part, mesh=mesh)
    n2 = sum(1 for _ in double.parameters())
    per_read = max((_reads(double) - read) / max(n2 - tensors, 1), 0.0)
    return max(read - tensors * per_read, 0.0), per_read


def _fill_s(fill: Callable[[nn.Module], None], module: nn.Module, nbytes: float,
            zero_bps: float) -> float:
    """Seconds to give ``module`` storage, less what zeroing its bytes alone takes."""
    return max(_timed(lambda: fill(module)) - (nbytes / zero_bps if zero_bps > 0 else 0.0), 0.0)


def _once(model: ModelSpec | None, zero_bps: float) -> dict[str, float]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    subject = _model_subject(model, mesh) if model is not None else _plain_subject(mesh)
    built: list[nn.Module] = []
    meta = _timed(lambda: built.append(subject.fresh()))
    tensors = sum(1 for _ in built[0].parameters())
    tp_s = tp_tensors = 0.0
    if subject.tp_divides:
        tp_chunk = subject.fresh()
        tp_s = _timed(lambda: subject.tp_style(tp_chunk))
        tp_tensors = sum(isinstance(p, DTensor) for p in tp_chunk.parameters())
    sharded, unit, fsdp_tensor_s = _sharding(subject, mesh, tensors)
    nbytes = sum(p._local_tensor.numel() * 4 for p in sharded.parameters())  # type: ignore[attr-defined]
    fill_s = _fill_s(subject.storage, sharded, nbytes, zero_bps)
    call_s, per_read = _read_costs(subject, sharded, mesh, tensors)
    plain = subject.fresh()  # the same without sharding: a DDP or pipeline-only rank's tensors
    plain_fill_s = _fill_s(subject.storage_plain, plain,
                           sum(p.numel() * 4 for p in plain.parameters()), zero_bps)
    plain_read = _reads(plain)

    def install() -> None:
        for p in sharded.parameters():
            local_box(p)
            for _ in range(2):
                local_box(torch.empty_like(p))

    install_s = _timed(install)
    return {"meta_tensor_s": meta / tensors, "tp_tensor_s": tp_s / max(tp_tensors, 1),
            "fsdp_unit_s": unit, "fsdp_tensor_s": fsdp_tensor_s,
            "materialize_tensor_s": fill_s / tensors, "state_tensor_s": per_read,
            "plain_materialize_tensor_s": plain_fill_s / tensors,
            "plain_state_tensor_s": max(plain_read - call_s, 0.0) / tensors,
            "state_call_s": call_s,
            "install_tensor_s": install_s / tensors}


def probe_costs(model: ModelSpec | None = None, *, zero_bps: float = 0.0,
                repeats: int = 3) -> dict[str, float]:
    """Median per-tensor (and per-unit) seconds over ``repeats`` probes after one warm-up, by
    ``MoveTimeModel`` field name (torch.distributed must be initialised); ``zero_bps``: the
    measured rate of allocating and zeroing fresh memory, taken out of the storage figure."""
    _once(model, zero_bps)  # warm-up: torch's first sharding of a kind fills its caches
    runs = [_once(model, zero_bps) for _ in range(repeats)]
    return {name: statistics.median(run[name] for run in runs) for name in runs[0]}
