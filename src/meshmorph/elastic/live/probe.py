"""Per-tensor costs of building, sharding, filling and reading an engine, measured on a probe.

The probe is one decoder block of the job's model (``run/models.build_chunk`` on the meta
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

import torch
import torch.distributed as dist
from torch import nn

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


def _once(model: ModelSpec | None, zero_bps: float) -> dict[str, float]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from meshmorph.elastic.live.local_state import local_box

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    if model is not None:
        from meshmorph.run.model.decoder import build_chunk
        from meshmorph.run.model.materialize import materialize_, state_installed_after
        from meshmorph.run.parallel.parallelize import apply_tp

        layer = _decoder_layer(model)

        def fresh() -> nn.Module:
            return build_chunk(model, layer, layer + 1, seed=0, device="meta")

        two_blocks: Callable[[], nn.Module] | None = None
        if layer + 1 < len(model.layers) and model.layers[layer + 1].kind == LayerKind.BLOCK:
            def two_blocks() -> nn.Module:
                return build_chunk(model, layer, layer + 2, seed=0, device="meta")

        def tp_style(chunk: nn.Module) -> None:
            apply_tp(chunk, model, mesh, False)  # type: ignore[arg-type]

        def blocks(chunk: nn.Module) -> list[nn.Module]:
            return list(chunk.blocks.values())  # type: ignore[operator]

        def storage(chunk: nn.Module) -> None:
            with state_installed_after():
                materialize_(chunk, model, seed=0, device="cpu")

        storage_plain = storage
        tp_divides = model.num_heads % world == 0 and model.num_kv_heads % world == 0 \
            and model.ffn_hidden_size % world == 0
    else:
        def fresh() -> nn.Module:
            return _plain_blocks()

        two_blocks = None

        def tp_style(chunk: nn.Module) -> None:
            for block in chunk:
                parallelize_module(block, mesh, {"0": ColwiseParallel(),
                                                 "2": RowwiseParallel()})

        def blocks(chunk: nn.Module) -> list[nn.Module]:
            return list(chunk)

        def storage(chunk: nn.Module) -> None:
            chunk.to_empty(device="cpu")
            with torch.no_grad():
                for p in chunk.parameters():
                    p._local_tensor.zero_()  # type: ignore[attr-defined]

        def storage_plain(chunk: nn.Module) -> None:
            chunk.to_empty(device="cpu")
            with torch.no_grad():
                for p in chunk.parameters():
                    p.zero_()
        tp_divides = True

    built: list[nn.Module] = []
    meta = _timed(lambda: built.append(fresh()))
    tensors = sum(1 for _ in built[0].parameters())
    tp_s = tp_tensors = 0.0
    if tp_divides:
        tp_chunk = fresh()
        tp_s = _timed(lambda: tp_style(tp_chunk))
        tp_tensors = sum(isinstance(p, DTensor) for p in tp_chunk.parameters())
    # units: every block, then the whole chunk (as apply_dp shards); against the chunk alone
    sharded = built[0]
    units = [*blocks(sharded), sharded]
    many_s = _timed(lambda: [fully_shard(u, mesh=mesh) for u in units])
    one = fresh()
    one_s = _timed(lambda: fully_shard(one, mesh=mesh))
    unit = max((many_s - one_s) / max(len(units) - 1, 1), 0.0)
    nbytes = sum(p._local_tensor.numel() * 4 for p in sharded.parameters())  # type: ignore[attr-defined]
    fill_s = _timed(lambda: storage(sharded))
    fill_s = max(fill_s - (nbytes / zero_bps if zero_bps > 0 else 0.0), 0.0)
    # a state-dict read costs per call and per tensor: the one-block chunk against a chunk
    # of two blocks (on the meta device: an extract takes views, it copies nothing)
    read = _timed(lambda: [local_box(v) for v in get_model_state_dict(sharded).values()])
    call_s, per_read = 0.0, read / tensors
    if two_blocks is not None:
        double = two_blocks()
        for part in [*blocks(double), double]:
            fully_shard(part, mesh=mesh)
        n2 = sum(1 for _ in double.parameters())
        read2 = _timed(lambda: [local_box(v) for v in get_model_state_dict(double).values()])
        per_read = max((read2 - read) / max(n2 - tensors, 1), 0.0)
        call_s = max(read - tensors * per_read, 0.0)

    # the same without sharding: plain tensors (a DDP or pipeline-only rank's)
    plain = fresh()
    plain_bytes = sum(p.numel() * 4 for p in plain.parameters())
    plain_fill_s = max(_timed(lambda: storage_plain(plain))
                       - (plain_bytes / zero_bps if zero_bps > 0 else 0.0), 0.0)
    plain_read = _timed(lambda: [local_box(v) for v in get_model_state_dict(plain).values()])

    def install() -> None:
        for p in sharded.parameters():
            local_box(p)
            for _ in range(2):
                local_box(torch.empty_like(p))

    install_s = _timed(install)
    return {"meta_tensor_s": meta / tensors, "tp_tensor_s": tp_s / max(tp_tensors, 1),
            "fsdp_unit_s": unit, "fsdp_tensor_s": max(one_s - unit, 0.0) / tensors,
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
