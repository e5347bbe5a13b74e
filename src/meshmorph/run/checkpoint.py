"""Checkpoints through torch.distributed.checkpoint, committed atomically.

Every rank saves into ``step-N.tmp-<uuid>``; after all ranks finished (a barrier), rank 0 writes a
``COMPLETE`` marker (step, consumed samples, plan, size and SHA-256 of every file) and renames
the folder to ``step-N``. A folder without the marker is never loaded. Model and optimizer
state go through ``get_*_state_dict`` with the parameters' original names, so a checkpoint loads
into any other Plan (DCP reshards on load). Per-rank RNG states and the LR-scheduler state go
into a small ``extra-rank<r>.pt`` per rank.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MARKER = "COMPLETE"
PREFIX = "step-"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: the message names the folder and a way out."""


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """A committed checkpoint, as its marker describes it."""

    path: Path
    """The ``step-N`` folder."""
    step: int
    """Optimizer steps done when it was saved."""
    consumed_samples: int
    """Samples of the order consumed when it was saved (the data-loader position)."""
    plan: dict[str, Any]
    """The Plan (as JSON) the run had when it saved."""


def _step_of(path: Path) -> int | None:
    name = path.name
    if not name.startswith(PREFIX) or not name[len(PREFIX):].isdigit():
        return None
    return int(name[len(PREFIX):])


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def scan_checkpoints(ckpt_dir: Path) -> tuple[list[Path], list[Path]]:
    """(``step-N`` folders with a marker, oldest first; folders that are ignored: ``*.tmp-*``
    left by an interrupted save and ``step-N`` without a marker)."""
    complete, ignored = [], []
    if not ckpt_dir.is_dir():
        return complete, ignored
    for entry in sorted(ckpt_dir.iterdir()):
        if not entry.is_dir():
            continue
        if _step_of(entry) is not None and (entry / MARKER).is_file():
            complete.append(entry)
        elif entry.name.startswith(PREFIX):
            ignored.append(entry)
    complete.sort(key=lambda p: _step_of(p) or 0)
    return complete, ignored


def verify_checkpoint(path: Path, *, checksums: bool = True) -> CheckpointInfo:
    """Read the marker and check every file it lists (present, same size, same SHA-256)."""
    try:
        marker = json.loads((path / MARKER).read_text())
        files: dict[str, dict[str, Any]] = marker["files"]
        info = CheckpointInfo(path, int(marker["step"]), int(marker["consumed_samples"]),
                              marker["plan"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {path} has an unreadable {MARKER} marker ({exc})") from None
    for name, expected in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} is corrupted: file {name} is missing")
        size = file.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointError(
                f"checkpoint {path} is corrupted: file {name} has {size} bytes, the marker says "
                f"{expected['bytes']}"
            )
        if checksums and _sha256(file) != expected["sha256"]:
            raise CheckpointError(
                f"checkpoint {path} is corrupted: file {name} does not match its SHA-256"
            )
    return info


def _warn(message: str) -> None:
    print(f"meshmorph: warning: {message}", file=sys.stderr, flush=True)


def latest_checkpoint(ckpt_dir: Path, *, checksums: bool = True,
                      warn: Callable[[str], None] = _warn) -> CheckpointInfo | None:
    """The newest committed checkpoint, verified; None if there is none. Warns about ignored
    folders; a corrupted newest checkpoint raises and names the previous one."""
    complete, ignored = scan_checkpoints(ckpt_dir)
    for path in ignored:
        warn(f"ignoring {path}: no {MARKER} marker (left by an interrupted save)")
    if not complete:
        return None
    try:
        return verify_checkpoint(complete[-1], checksums=checksums)
    except CheckpointError as exc:
        if len(complete) > 1:
            hint = (f"; the previous checkpoint is {complete[-2]}: move {complete[-1].name} out of "
                    f"{ckpt_dir} (for example rename it to {complete[-1].name}.bad) and resume again")
        else:
            hint = "; no earlier checkpoint exists: move it aside and start without --resume"
        raise CheckpointError(f"{exc}{hint}") from None


def commit_checkpoint(tmp: Path, final: Path, *, step: int, consumed_samples: int,
                      plan: dict[str, Any]) -> None:
    """Write the marker into ``tmp`` (listing every file in it) and rename it to ``final``."""
    files = {
        str(file.relative_to(tmp)): {"bytes": file.stat().st_size, "sha256": _sha256(file)}
        for file in sorted(tmp.rglob("*")) if file.is_file()
    }
    marker = {"step": step, "consumed_samples": consumed_samples, "plan": plan, "files": files}
    staging = tmp / f"{MARKER}.partial"
    with staging.open("w") as handle:
        json.dump(marker, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    staging.rename(tmp / MARKER)
    if final.exists():  # a resumed run saves a step again: swap, then drop the old folder
        old = final.with_name(f"{final.name}.old-{uuid.uuid4().hex[:8]}")
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)


def prune_checkpoints(ckpt_dir: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` committed checkpoints; returns the deleted folders."""
    complete, _ = scan_checkpoints(ckpt_dir)
    doomed = complete[:-keep] if keep > 0 else []
    for path in doomed:
        shutil.rmtree(path)
    return doomed


# --- torch side: what is saved and loaded ---------------------------------------------------
def _engine_state(engine: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    if len(engine.model_parts) != len(engine.optimizers):
        raise CheckpointError(
            f"checkpoints need one optimizer per model part, the engine has "
            f"{len(engine.model_parts)} parts and {len(engine.optimizers)} optimizers"
        )
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    model: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    for part, optimizer in zip(engine.model_parts, engine.optimizers, strict=True):
        model.update(get_model_state_dict(part))
        optim.update(get_optimizer_state_dict(part, optimizer, options=flat))
    return {"model": model, "optim": optim}


def _extra_state(engine: Any) -> dict[str, Any]:
    import torch

    return {
        "cpu_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "lr_scheduler": engine.lr_schedulers[0].state_dict() if engine.lr_schedulers else None,
    }


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if _distributed():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    import torch.distributed as dist

    if _distributed():
        dist.barrier()


def _from_rank0(value: Any) -> Any:
    import torch.distributed as dist

    if _distributed():
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return value


def save_checkpoint(engine: Any, ckpt_dir: Path, *, step: int, consumed_samples: int,
                    plan: dict[str, Any], keep: int) -> Path:
    """Save on every rank (collective); returns the committed ``step-N`` folder."""
    import torch
    import torch.distributed.checkpoint as dcp

    rank, _ = _rank_world()
    tmp = ckpt_dir / f"{PREFIX}{step}.tmp-{_from_rank0(uuid.uuid4().hex[:12])}"
    if rank == 0:
        tmp.mkdir(parents=True)
    _barrier()
    dcp.save(_engine_state(engine), checkpoint_id=str(tmp), no_dist=not _distributed())
    torch.save(_extra_state(engine), tmp / f"extra-rank{rank}.pt")
    _barrier()  # every rank's files are on disk
    final = ckpt_dir / f"{PREFIX}{step}"
    if rank == 0:
        commit_checkpoint(tmp, final, step=step, consumed_samples=consumed_samples, plan=plan)
        prune_checkpoints(ckpt_dir, keep)
    _barrier()  # nobody runs ahead (or exits) before the commit
    return final


def load_checkpoint(engine: Any, info: CheckpointInfo) -> None:
    """Load model, optimizer, LR scheduler and (same world size only) RNG states (collective).
    The Plan may differ from the one that saved: DCP reshards."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    rank, world = _rank_world()
    state = _engine_state(engine)
    dcp.load(state, checkpoint_id=str(info.path), no_dist=not _distributed())
    for part, optimizer in zip(engine.model_parts, engine.optimizers, strict=True):
        set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
        set_optimizer_state_dict(part, optimizer, state["optim"],
                                 options=StateDictOptions(flatten_optimizer_state_dict=True))
    own = info.path / f"extra-rank{rank}.pt"
    saved_world = int(info.plan.get("world_size", 0))
    extra = torch.load(own if own.is_file() else info.path / "extra-rank0.pt", weights_only=False)
    if extra["lr_scheduler"] is not None:
        for scheduler in engine.lr_schedulers:
            scheduler.load_state_dict(extra["lr_scheduler"])
    if saved_world == world and own.is_file():  # RNG streams belong to ranks of the same layout
        torch.set_rng_state(extra["cpu_rng"])
        if extra["cuda_rng"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(extra["cuda_rng"])
