"""The ``state`` line: what each rank holds and sends in the first step, beside the prediction.

``TrainEngine.step`` records, in its first step, this rank's bytes at the end of backward (before
anything touches the gradients): ``params_bytes`` (every live storage behind the chunk's
parameters: the fp32 masters, and for FSDP2 the sharded fp32 storage plus every unsharded copy it
still holds), ``grads_bytes`` (every live storage behind the gradients: DDP's buckets, FSDP2's
sharded and unsharded gradients and the whole gradients it accumulates without sync), both
deduplicated by storage; after the step, ``optimizer_bytes`` (AdamW's moments, the per-tensor
step counters left out), ``peak_state_bytes`` without a pipeline (the most parameter and gradient
bytes at the end of any micro-batch's backward, plus the moments: ZeRO-1's whole gradients
accumulated between micro-batches are there) and ``comm_bytes`` (run/engine/comm_count.py: bytes
sent per collective kind over the whole step, meshmorph's own loss and gradient-norm reductions
included). ``write_state_line`` gathers every rank's record on rank 0,
puts the cost model's prediction for that rank beside it (cost/rank_state.py; for a plan whose
layers' strategies differ, segment by segment) and writes
``{"event": "state", "ranks": [{"rank", "measured", "predicted"}, ...]}`` once.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from meshmorph.cost.rank_state import predict_peak_bytes, predict_rank_state
from meshmorph.spec.gpus import GPU_CATALOG
from meshmorph.spec.model import ModelSpec
from meshmorph.spec.plan import Plan

if TYPE_CHECKING:
    from meshmorph.run.engine.train_engine import TrainEngine
    from meshmorph.run.metrics import MetricsLogger


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor  # type: ignore[attr-defined]


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct live storages behind ``tensors`` (a storage counted once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if tensor is None:
            continue
        storage = _local(tensor).untyped_storage()
        if storage.nbytes() > 0:
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _fsdp_params(engine: TrainEngine) -> list[Any]:
    """FSDP2's per-parameter records (FSDPParam) of every fully_shard/replicate module."""
    found = []
    for part in engine.model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                for group in module._get_fsdp_state()._fsdp_param_groups:
                    found.extend(group.fsdp_params)
    return found


def held_bytes(engine: TrainEngine) -> dict[str, object]:
    """This rank's parameter and gradient bytes now (call at the end of backward)."""
    params: list[torch.Tensor | None] = []
    grads: list[torch.Tensor | None] = []
    for part in engine.model_parts:
        for param in part.parameters():
            params.append(param)
            grads.append(param.grad)
    for record in _fsdp_params(engine):
        params.append(record.sharded_param)
        grads.append(record.sharded_param.grad)
        params.extend(record.all_gather_outputs)  # the unsharded copy FSDP2 may still hold
        unsharded = getattr(record, "_unsharded_param", None)
        if unsharded is not None:
            params.append(unsharded)
            grads.append(unsharded.grad)
        grads.append(record.unsharded_accumulated_grad)  # accumulated without gradient sync
    return {"params_bytes": storage_bytes(params), "grads_bytes": storage_bytes(grads)}


def state_bytes(held: dict[str, object]) -> int:
    """Parameter and gradient bytes of a ``held_bytes`` record."""
    return int(held["params_bytes"]) + int(held["grads_bytes"])  # type: ignore[call-overload]


def optimizer_bytes(engine: TrainEngine) -> int:
    """Bytes of the optimizers' moments on this rank (step counters left out)."""
    moments = [value for opt in engine.optimizers for state in opt.state.values()
               for key, value in state.items()
               if key != "step" and isinstance(value, torch.Tensor)]
    return storage_bytes(moments)


def measured_state(engine: TrainEngine) -> dict[str, object]:
    """This rank's measured figures of the captured step (and, on CUDA, its peak allocation)."""
    if engine.captured_state is None:
        raise RuntimeError("no step has been captured yet: call write_state_line after a step")
    measured = dict(engine.captured_state)
    if engine.device.type == "cuda":
        measured["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(engine.device)
    return measured


def catalog_gpu(device: torch.device) -> str | None:
    """The GPU catalog's name for a CUDA device (by part name, then memory size), or None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    memory_gib = torch.cuda.get_device_properties(device).total_memory / 2**30
    matches = [key for key in GPU_CATALOG if key.split("-")[0] in name and key != "cpu"]
    if not matches:
        return None
    return min(matches, key=lambda key: abs(GPU_CATALOG[key].memory_gib - memory_gib))


def state_records(model: ModelSpec, plan: Plan, measured: list[dict[str, object]], *,
                  gpu: str | None = None) -> list[dict[str, object]]:
    """One record per rank: its measured figures beside the cost model's (and, on a catalog
    ``gpu``, the predicted peak allocation beside the measured one)."""
    records = []
    for rank, m in enumerate(measured):
        predicted = predict_rank_state(model, plan, rank)
        if gpu is not None and "peak_allocated_bytes" in m:
            predicted["peak_allocated_bytes"] = predict_peak_bytes(model, plan, rank, gpu)
        records.append({"rank": rank, "measured": m, "predicted": predicted})
    return records


def state_summary(records: list[dict[str, Any]], step: int = 1) -> str:
    """One line for the console: the largest gap between measured and predicted, over every
    rank and every figure (held bytes and each kind of bytes sent), measured after ``step``."""
    worst, where = 0.0, ""
    for record in records:
        measured, predicted = record["measured"], record["predicted"]
        pairs = [(key, measured[key], predicted.get(key, 0))
                 for key in measured if key != "comm_bytes"]
        pairs += [(f"{kind} bytes", sent, predicted["comm_bytes"].get(kind, 0))
                  for kind, sent in measured["comm_bytes"].items()]
        for key, got, want in pairs:
            gap = abs(got - want) / max(abs(want), 1)
            if gap > worst:
                worst, where = gap, f" (rank {record['rank']}, {key}: measured {got:,} vs {want:,.0f})"
    held = sum(r["measured"]["params_bytes"] + r["measured"]["grads_bytes"]
               + r["measured"]["optimizer_bytes"] for r in records)
    return (f"state after step {step}: {len(records)} ranks hold {held / 2**20:,.1f} MiB of parameters, "
            f"gradients and optimizer state; measured vs predicted: largest gap "
            f"{worst:.2%}{where} (metrics.jsonl \"state\" line)")


def write_state_line(engine: TrainEngine, metrics: MetricsLogger, step: int = 1) -> None:
    """Gather every rank's measured state on rank 0 and write the ``state`` line, once per
    engine, after its first step (``step``: a restored engine's first is a later one of the run)
    (collective: every rank calls it after the same step; later calls do nothing)."""
    if engine.state_written or engine.captured_state is None:
        return
    gathered: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
    dist.gather_object(measured_state(engine), gathered if dist.get_rank() == 0 else None, dst=0)
    engine.state_written = True
    if dist.get_rank() == 0:
        records = state_records(engine.spec, engine.plan, gathered, gpu=catalog_gpu(engine.device))
        metrics.log_event({"event": "state", "after_step": step, "ranks": records})
        print(state_summary(records, step), flush=True)
