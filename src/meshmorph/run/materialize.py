"""Meta-device initialisation: each rank allocates and fills only its own shards.

A chunk is built on the meta device (``build_chunk(..., device="meta")``: no storage, no init),
parallelized there (tensor parallelism makes its parameters DTensors, FSDP2 ``fully_shard`` makes
them dim-0 shards, padded where the dim does not divide), and only then ``materialize_`` gives it
storage: ``Module.to_empty`` allocates this rank's local tensors on the device, and each one is
filled with the slice of the one-device model's value at the positions this rank holds. Torch says
which positions those are (``compute_local_shape_and_global_offset``, the rule DCP uses), so no
sharding rule is repeated here.

One parameter's full value is drawn at a time and dropped once its slice is copied, so the host
peak is about this rank's share plus one largest tensor. Every parameter has its own generator
(``models.init_value``), so no rank draws a value it does not keep, and every layout, including
the one-device reference ``build_model``, starts from bitwise the same weights.

DistributedDataParallel needs real tensors: wrap a chunk in DDP only after ``materialize_``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from meshmorph.run.models import init_value, layer_of
from meshmorph.spec.model import ModelSpec


def _tied_names(chunk: nn.Module) -> list[list[str]]:
    """Names of each parameter the chunk holds under more than one name (a tied head)."""
    names: dict[int, list[str]] = {}
    for name, param in chunk.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _retie(chunk: nn.Module, groups: list[list[str]]) -> None:
    """Make every name of a tied group the same Parameter again (``to_empty`` may have given
    each module a new one)."""
    for first, *others in groups:
        shared = chunk.get_parameter(first)
        for name in others:
            owner, _, attr = name.rpartition(".")
            module = chunk.get_submodule(owner)
            if module._parameters[attr] is not shared:
                module._parameters[attr] = shared


def _local_box(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...] | None]:
    """This rank's storage of ``tensor`` and the box of the global tensor it holds (None: all)."""
    if not isinstance(tensor, DTensor):
        return tensor, None
    shape, offset = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements)
    return tensor._local_tensor, tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def fill_from_reference_(tensor: torch.Tensor, full: torch.Tensor) -> None:
    """Copy into ``tensor`` (plain, or this rank's shard of a DTensor) its slice of ``full``."""
    local, box = _local_box(tensor)
    part = full if box is None else full[box]
    if tuple(part.shape) != tuple(local.shape):
        raise ValueError(f"local shard of shape {list(local.shape)} does not match its box "
                         f"{box} of the global shape {list(full.shape)}")
    local.copy_(part)


def materialize_(chunk: nn.Module, spec: ModelSpec, *, seed: int,
                 device: torch.device | str) -> None:
    """Allocate this rank's local storage of every parameter of ``chunk`` on ``device`` and fill
    it with the one-device model's values (``build_model(spec, seed=seed)``) at its positions.

    ``chunk`` was built by ``build_chunk(..., device="meta")`` and may since have been tensor
    parallelized and/or FSDP2-sharded (parameter names unchanged), but not wrapped in DDP."""
    real = [name for name, p in chunk.named_parameters() if not p.is_meta]
    if real:
        raise ValueError(f"materialize_ takes a chunk on the meta device, but {real[0]} already "
                         "has storage; build it with build_chunk(..., device='meta')")
    buffers = [name for name, _ in chunk.named_buffers()]
    if buffers:  # the decoders hold none; a new one needs its value in models.init_value
        raise ValueError(f"buffer {buffers[0]} has no reference value; give it one in "
                         "models.init_value before building on the meta device")
    groups = _tied_names(chunk)
    chunk.to_empty(device=device)
    _retie(chunk, groups)
    with torch.no_grad():
        for name, tensor in chunk.named_parameters():
            layer, local_name = layer_of(spec, name)
            full = init_value(spec, layer, local_name, tuple(tensor.shape), seed=seed)
            fill_from_reference_(tensor, full)
            del full  # one whole tensor at a time
