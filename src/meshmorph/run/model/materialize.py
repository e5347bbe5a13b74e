"""Meta-device initialisation: each rank allocates and fills only its own shards.

A chunk is built on the meta device (``build_chunk(..., device="meta")``: no storage, no init),
parallelized there (tensor parallelism makes its parameters DTensors, FSDP2 ``fully_shard`` makes
them dim-0 shards, padded where the dim does not divide), and only then ``materialize_`` gives it
storage: ``Module.to_empty`` allocates this rank's local tensors on the device, and each one is
filled with the slice of the one-device model's value at the positions this rank holds. Torch says
which positions those are (``compute_local_shape_and_global_offset``, the rule DCP uses), so no
sharding rule is repeated here.

Initialisation is block-stable (``models.init_value``): a parameter's value is drawn in row
blocks of at most ``INIT_BLOCK_BYTES`` (1 MiB), each from its own generator, with block bounds
fixed by the parameter's shape alone. Each rank draws only the blocks that overlap its shard's
rows, one at a time, and writes each block's part (its rows, and its columns for a column split)
straight into its local storage, so the host peak is this rank's share plus one block, and every
layout, including the one-device reference ``build_model``, starts from bitwise the same weights.

DistributedDataParallel needs real tensors: wrap a chunk in DDP only after ``materialize_``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from meshmorph.run.model.decoder import fill_init_value_, layer_of
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


_DRAW_INIT = contextvars.ContextVar("meshmorph_draw_init", default=True)


@contextlib.contextmanager
def state_installed_after() -> Iterator[None]:
    """Within it, ``materialize_`` zeroes each rank's storage instead of drawing the initial
    values: for an engine whose whole state is written right after (a reshape's new engine,
    ``elastic/local_state.install_state``), where drawing them is most of the build."""
    token = _DRAW_INIT.set(False)
    try:
        yield
    finally:
        _DRAW_INIT.reset(token)


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
            local, box = _local_box(tensor)  # the positions this rank holds, filled in place
            if not _DRAW_INIT.get():
                local.zero_()
                continue
            fill_init_value_(local, spec, layer, local_name, tuple(tensor.shape), seed=seed,
                             box=box)
