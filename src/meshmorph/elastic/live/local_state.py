"""The training state one rank holds, as pieces: taken out of a live engine, put into a new one.

A piece is a box of one state tensor, keyed as ``Layout`` keys them. Torch says which box a
rank holds (``compute_local_shape_and_global_offset``, DCP's rule: FSDP2's unpadded dim-0
shards, TP splits, ZeRO-1's strided moment shards), so no sharding rule is repeated here; the live tensors are the state dicts' views under the parameters' original
names, as a checkpoint saves them. ``SmallState`` travels beside the pieces.

``content_hash`` is position-keyed: the wrapping int64 sum over elements of a mix of (global
element index, value bits), so the hashes of pieces that tile a tensor add up to the whole
tensor's whatever the layout, and ``state_hashes`` of two plans compare tensor by tensor.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from meshmorph.elastic.moves.box import Box
from meshmorph.elastic.moves.layout import MOMENTS
from meshmorph.elastic.moves.placement import ReshapeError
from meshmorph.run.checkpoint import TIED_EMBEDDING, TIED_HEAD

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
_MASK = (1 << 64) - 1
_C1, _C2, _C3 = 0x9E3779B97F4A7C15 - (1 << 64), 0x5851F42D4C957F2D, 0x2545F4914F6CDD1D


@dataclass(frozen=True, slots=True)
class HeldPiece:
    """One box of one state tensor, held in this process as a plain tensor."""

    key: str
    """``param/<fqn>``, ``exp_avg/<fqn>`` or ``exp_avg_sq/<fqn>``."""
    offset: tuple[int, ...]
    """Where the box starts in the global tensor, per dimension."""
    global_shape: tuple[int, ...]
    """Shape of the whole tensor."""
    tensor: torch.Tensor
    """The box's values (its shape is the box's length per dimension)."""

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


@dataclass(slots=True)
class SmallState:
    """The state that is not a sharded tensor (the same on every rank except ``rng``)."""

    step: int
    """AdamW steps taken (every parameter's ``step``)."""
    param_group: dict[str, Any]
    """The optimizer's hyperparameters as the LR schedule left them (``lr``, ``initial_lr``...)."""
    lr_scheduler: dict[str, Any] | None
    """``LRScheduler.state_dict()``."""
    rng: torch.Tensor
    """This rank's CPU generator state."""
    consumed_samples: int
    """The data position: samples of the order trained on."""
    loss_scaler: dict[str, Any] | None = None
    """The fp16 loss scaler's fields (``run.loss_scale.LossScaler``: scale, good and skipped
    steps); None where the plan trains without one."""


@dataclass(slots=True)
class LocalState:
    """Everything one rank holds: tensor pieces by key, small state, and where they came from."""

    pieces: dict[str, list[HeldPiece]]
    """Pieces of each state tensor this rank holds (one per key, except after a move)."""
    small: SmallState
    """Step, optimizer hyperparameters, LR scheduler, RNG, data position."""
    fingerprint: str
    """Topology fingerprint of the plan that laid the pieces out (``topology_fingerprint``)."""

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for ps in self.pieces.values() for p in ps)


def topology_fingerprint(plan_json: str, world_size: int) -> str:
    """Short SHA-256 of a plan and its world size: pieces are only read against their own plan."""
    return hashlib.sha256(f"{world_size}|{plan_json}".encode()).hexdigest()[:16]


def content_hash(tensor: torch.Tensor, offset: tuple[int, ...], global_shape: tuple[int, ...],
                 rows_per_block: int = 1 << 14) -> int:
    """Position-keyed hash of a box (see the module docstring); additive over a tiling, mod 2**64."""
    if tensor.numel() == 0:
        return 0
    t = tensor.detach().contiguous()
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    t = t.view(bits) if t.dim() else t.reshape(1).view(bits)
    shape = tuple(global_shape) or (1,)
    offs = tuple(offset) or (0,)
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):  # row-major strides of the global tensor
        strides[d] = strides[d + 1] * shape[d + 1]
    total = 0
    for start in range(0, t.shape[0], rows_per_block):
        block = t[start:start + rows_per_block].to(torch.int64)
        idx = torch.zeros((), dtype=torch.int64)
        for d in range(block.dim()):  # global linear index of every element
            n = block.shape[d]
            pos = torch.arange(n, dtype=torch.int64) + offs[d] + (start if d == 0 else 0)
            idx = idx + (pos * strides[d]).reshape([n if k == d else 1 for k in range(block.dim())])
        x = block * _C2 + idx * _C1  # wraps in int64
        x = x ^ (x >> 29)
        x = x * _C3
        x = x ^ (x >> 32)
        total = (total + int(x.sum())) & _MASK
    return total


def local_box(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """This rank's storage of ``tensor`` and the offset of its box in the global tensor."""
    if not isinstance(tensor, DTensor):
        return tensor, (0,) * tensor.dim()
    shape, offset = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements)
    local = tensor._local_tensor  # type: ignore[attr-defined]
    if tuple(local.shape) != tuple(shape):
        raise ReshapeError(f"local shard shape {list(local.shape)} differs from torch's box "
                           f"{list(shape)}; a padded shard cannot be read as a box")
    return local, tuple(offset)


def _engine_dicts(engine: Any, *, init_optimizer: bool = False
                  ) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(model state dict, flattened optimizer state dict) per model part. An optimizer that has
    not stepped yet gives an empty dict unless ``init_optimizer``: torch initialises its state
    by a step with zero gradients, which would count as AdamW's first step."""
    fresh = not any(opt.state for opt in engine.optimizers)
    return [(get_model_state_dict(part),
             get_optimizer_state_dict(part, opt, options=_FLAT)
             if init_optimizer or not fresh else {})
            for part, opt in zip(engine.model_parts, engine.optimizers, strict=True)]


def _optim_entries(optim: dict[str, Any]) -> Iterator[tuple[str, str, str]]:
    """(name, parameter fqn, field) of every per-parameter entry (``state.<fqn>.<field>``) of a
    flattened optimizer state dict."""
    for name in list(optim):
        if name.startswith("state."):
            fqn, _, what = name[len("state."):].rpartition(".")
            yield name, fqn, what


def state_tensors(engine: Any) -> dict[str, torch.Tensor]:
    """Layout key -> this rank's live tensor (a DTensor or a whole plain tensor)."""
    found: dict[str, torch.Tensor] = {}
    tied = bool(engine.spec.tied_embeddings)
    for model, optim in _engine_dicts(engine):
        named = dict(model)
        named.update((f"{what}/{fqn}", optim[name]) for name, fqn, what in _optim_entries(optim)
                     if what in MOMENTS)
        for name, value in named.items():
            if tied and TIED_HEAD in name:  # Layout names a tied head by its embedding
                name = name.replace(TIED_HEAD, TIED_EMBEDDING)
                if name in named:  # the embedding is on this rank too: one tensor
                    continue
            found[name if "/" in name else f"param/{name}"] = value
    return found


def extract_state(engine: Any, *, consumed_samples: int) -> LocalState:
    """The pieces and small state this rank's engine holds (views, not copies)."""
    pieces: dict[str, list[HeldPiece]] = {}
    for key, value in state_tensors(engine).items():
        local, offset = local_box(value)
        pieces[key] = [HeldPiece(key, offset, tuple(value.shape), local.detach())]
    opt = engine.optimizers[0]
    steps = [float(s["step"]) for s in opt.state.values() if "step" in s]
    group = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    scaler = getattr(engine, "scaler", None)
    small = SmallState(step=int(steps[0]) if steps else 0, param_group=group,
                       lr_scheduler=engine.lr_schedulers[0].state_dict(),
                       rng=torch.get_rng_state(), consumed_samples=consumed_samples,
                       loss_scaler=dataclasses.asdict(scaler) if scaler is not None else None)
    world = dist.get_world_size() if dist.is_initialized() else 1
    return LocalState(pieces, small, topology_fingerprint(engine.plan.to_json(), world))


def _sources(key: str, pieces: dict[str, list[HeldPiece]], tied: bool) -> list[HeldPiece]:
    """Pieces to read ``key`` from: its own, or for a tied head the embedding's."""
    if key in pieces:
        return pieces[key]
    if tied and TIED_HEAD in key:
        return pieces.get(key.replace(TIED_HEAD, TIED_EMBEDDING), [])
    return []


def fill_box_(local: torch.Tensor, offset: tuple[int, ...], sources: list[HeldPiece]) -> int:
    """Copy into ``local`` (the box at ``offset``) every overlap with ``sources``; elements set."""
    covered, box = 0, Box(offset, tuple(local.shape))
    for piece in sources:
        common = box.intersect(Box(piece.offset, piece.shape))
        if common is not None:
            local[common.slices_from(offset)].copy_(piece.tensor[common.slices_from(piece.offset)])
            covered += common.numel
    return covered


_WRAPPERS = re.compile(r"(^|\.)(_checkpoint_wrapped_module|_orig_mod)(?=\.|$)")


def _fill(key: str, value: torch.Tensor, pieces: dict[str, list[HeldPiece]], tied: bool) -> None:
    local, offset = local_box(value)
    covered = fill_box_(local, offset, _sources(key, pieces, tied))
    if covered != local.numel():
        raise ReshapeError(
            f"{key}: the pieces at hand cover {covered} of the {local.numel()} elements "
            f"of box offset {list(offset)} shape {list(local.shape)}; the move plan left "
            "part of it behind (or sent it twice)")


def _install_direct(engine: Any, pieces: dict[str, list[HeldPiece]], small: SmallState) -> bool:
    """``install_state`` for engines whose optimizers are plain ``torch.optim.AdamW``: copy into
    every parameter's local storage in place and create AdamW's per-parameter state directly
    (``step``, ``exp_avg``, ``exp_avg_sq`` as its lazy initialisation makes them), instead of
    going through the state-dict API (whose first-use initialisation runs an optimizer step and
    whose setters copy every tensor again). False where it does not apply."""
    if any(type(opt) is not torch.optim.AdamW or opt.state for opt in engine.optimizers) or \
            any(g.get("amsgrad") for opt in engine.optimizers for g in opt.param_groups):
        return False
    tied = bool(engine.spec.tied_embeddings)
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    for part, opt in zip(engine.model_parts, engine.optimizers, strict=True):
        names = {id(p): _WRAPPERS.sub("", n) for n, p in part.named_parameters()}
        for group in opt.param_groups:
            for param in group["params"]:
                fqn = names[id(param)]
                _fill(f"param/{fqn}", param.data if not isinstance(param, DTensor) else param,
                      pieces, tied)
                if small.step <= 0:  # before AdamW's first step there are no moments
                    continue
                on_device = group.get("fused") or group.get("capturable")
                state = {"step": torch.full((), float(small.step), dtype=scalar,
                                            device=param.device if on_device else "cpu")}
                for what in MOMENTS:
                    state[what] = torch.empty_like(param, memory_format=torch.preserve_format)
                    _fill(f"{what}/{fqn}", state[what], pieces, tied)
                opt.state[param] = state
    return True


@torch.no_grad()
def install_state(engine: Any, pieces: dict[str, list[HeldPiece]], small: SmallState) -> None:
    """Fill a freshly built engine's local shards from ``pieces`` (which must cover every box it
    holds, without overlap) and set its step, optimizer hyperparameters, LR scheduler, RNG and
    fp16 loss scaler."""
    if not _install_direct(engine, pieces, small):
        _install_by_state_dict(engine, pieces, small)
    for opt in engine.optimizers:
        for group in opt.param_groups:
            group.update({k: v for k, v in small.param_group.items() if k in group})
    if small.lr_scheduler is not None:
        for sched in engine.lr_schedulers:
            sched.load_state_dict(small.lr_scheduler)
    scaler = getattr(engine, "scaler", None)
    if scaler is not None and small.loss_scaler is not None:
        for name, value in small.loss_scaler.items():
            setattr(scaler, name, value)
    torch.set_rng_state(small.rng)


def _install_by_state_dict(engine: Any, pieces: dict[str, list[HeldPiece]],
                           small: SmallState) -> None:
    """``install_state`` through the state-dict API (any optimizer, ZeRO-1's sharded one too)."""
    tied = bool(engine.spec.tied_embeddings)
    stepped = small.step > 0  # before AdamW's first step there are no moments to install
    for (model, optim), part, opt in zip(_engine_dicts(engine, init_optimizer=stepped),
                                         engine.model_parts, engine.optimizers, strict=True):
        targets = {f"param/{fqn}": v for fqn, v in model.items()}
        for name, fqn, what in _optim_entries(optim):
            value = optim[name]
            if what in MOMENTS:
                targets[f"{what}/{fqn}"] = value
            elif what == "step":
                optim[name] = torch.full_like(value, float(small.step)) \
                    if isinstance(value, torch.Tensor) else small.step
        for key, value in targets.items():
            _fill(key, value, pieces, tied)
        set_model_state_dict(part, model, options=StateDictOptions(strict=False))
        if stepped:
            set_optimizer_state_dict(part, opt, optim, options=_FLAT)


def state_hashes(engine: Any, small: SmallState | None = None) -> dict[str, str]:
    """Per-tensor hash of the whole state the job holds (collective over the default group):
    every distinct box counted once; a tied head is its embedding. Small state is hashed too."""
    mine = {}
    for key, value in state_tensors(engine).items():
        if engine.spec.tied_embeddings and TIED_HEAD in key:
            continue
        local, offset = local_box(value)
        mine[(key, offset, tuple(local.shape))] = content_hash(local, offset, tuple(value.shape))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    merged: dict[tuple[Any, ...], int] = {}
    for part in gathered:
        merged.update(part)
    sums: dict[str, int] = {}
    for (key, _, _), value in merged.items():
        sums[key] = (sums.get(key, 0) + value) & _MASK
    out = {key: f"{value:016x}" for key, value in sorted(sums.items())}
    if small is not None:
        out["step"] = str(small.step)
        out["lr_scheduler"] = hashlib.sha256(json.dumps(small.lr_scheduler, sort_keys=True,
                                                        default=str).encode()).hexdigest()[:16]
        out["data"] = str(small.consumed_samples)
    return out
