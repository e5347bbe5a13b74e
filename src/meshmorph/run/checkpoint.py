"""Checkpoints through torch.distributed.checkpoint, committed atomically.

Every rank saves into ``step-N.tmp-<uuid>``, hashes the files it wrote (SHA-256) and reports them
to rank 0. Rank 0 writes ``manifest.json`` last (step, consumed samples, plan, run fingerprint, size
and SHA-256 of every file) to a temporary name, fsyncs it, renames it into place, fsyncs the folder,
renames the folder to ``step-N`` and fsyncs the checkpoint folder. Only then are older checkpoints
pruned, and the ``.tmp-`` folders of earlier interrupted saves removed. A ``.tmp-`` folder is an
interrupted save and is never loaded; a ``step-N`` folder without
a manifest, or whose files do not match it, is refused with the checkpoint to fall back to. Model
and optimizer state go through ``get_*_state_dict`` with the parameters' original names, so a
checkpoint loads into any other Plan (DCP reshards on load). Per-rank RNG states and the
LR-scheduler state go into a small ``extra-rank<r>.pt`` per rank.
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

from meshmorph.run import fault

MANIFEST = "manifest.json"
PREFIX = "step-"
TMP_INFIX = ".tmp-"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: the message names the folder and a way out."""


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """A committed checkpoint, as its manifest describes it."""

    path: Path
    """The ``step-N`` folder."""
    step: int
    """Optimizer steps done when it was saved."""
    consumed_samples: int
    """Samples of the order consumed when it was saved (the data-loader position)."""
    plan: dict[str, Any]
    """The Plan (as JSON) the run had when it saved."""
    fingerprint: dict[str, Any] | None = None
    """Model, data and plan identity of the run that saved it (None in a manifest without one)."""


def _step_of(path: Path) -> int | None:
    name = path.name
    if not name.startswith(PREFIX) or not name[len(PREFIX):].isdigit():
        return None
    return int(name[len(PREFIX):])


def sha256_of(path: Path) -> str:
    """SHA-256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_record(path: Path) -> dict[str, Any]:
    """What the manifest holds about one file: its size and SHA-256."""
    return {"bytes": path.stat().st_size, "sha256": sha256_of(path)}


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def step_folders(ckpt_dir: Path) -> list[Path]:
    """Every ``step-N`` folder (with or without a manifest), oldest first."""
    if not ckpt_dir.is_dir():
        return []
    found = [entry for entry in ckpt_dir.iterdir() if entry.is_dir() and _step_of(entry) is not None]
    return sorted(found, key=lambda p: _step_of(p) or 0)


def scan_checkpoints(ckpt_dir: Path) -> tuple[list[Path], list[Path]]:
    """(``step-N`` folders with a manifest, oldest first; other ``step-`` entries: ``*.tmp-*``
    left by an interrupted save, ``step-N`` without a manifest)."""
    if not ckpt_dir.is_dir():
        return [], []
    complete = [path for path in step_folders(ckpt_dir) if (path / MANIFEST).is_file()]
    ignored = sorted(entry for entry in ckpt_dir.iterdir()
                     if entry.name.startswith(PREFIX) and entry not in complete)
    return complete, ignored


def verify_checkpoint(path: Path, *, checksums: bool = True) -> CheckpointInfo:
    """Read the manifest and check every file it lists (present, same size, same SHA-256)."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        raise CheckpointError(
            f"checkpoint {path} is incomplete: {MANIFEST} is missing (a save that never committed "
            f"leaves a .tmp- folder, so this folder was damaged after its commit)"
        )
    try:
        data = json.loads(manifest.read_text())
        files: dict[str, dict[str, Any]] = data["files"]
        info = CheckpointInfo(path, int(data["step"]), int(data["consumed_samples"]),
                              dict(data["plan"]), data.get("fingerprint"))
        records = [(str(name), int(rec["bytes"]), str(rec["sha256"])) for name, rec in files.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"checkpoint {path} has an unreadable {MANIFEST} ({exc})") from None
    folder_step = _step_of(path)
    wrong = (f"says step {info.step}, but its folder is step {folder_step}"
             if folder_step is not None and info.step != folder_step else
             f"says consumed_samples {info.consumed_samples} (< 0)" if info.consumed_samples < 0
             else "lists no files" if not records else None)
    outside = [name for name, _, _ in records if Path(name).is_absolute() or ".." in Path(name).parts]
    if outside and not wrong:
        wrong = f"names {outside[0]}, a file outside its folder"

    if wrong:
        raise CheckpointError(f"checkpoint {path} has an inconsistent {MANIFEST}: it {wrong}")
    for name, size_bytes, sha in records:
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} is corrupted: file {name} is missing")
        size = file.stat().st_size
        if size != size_bytes:
            raise CheckpointError(
                f"checkpoint {path} is corrupted: file {name} has {size} bytes, the manifest says "
                f"{size_bytes}"
            )
        if checksums and sha256_of(file) != sha:
            raise CheckpointError(
                f"checkpoint {path} is corrupted: file {name} does not match its SHA-256"
            )
    return info


def _warn(message: str) -> None:
    print(f"meshmorph: warning: {message}", file=sys.stderr, flush=True)


def latest_checkpoint(ckpt_dir: Path, *, checksums: bool = True,
                      warn: Callable[[str], None] = _warn) -> CheckpointInfo | None:
    """The newest ``step-N`` checkpoint, verified; None if there is none. Warns about folders of
    interrupted saves; a damaged newest checkpoint raises and names the one before it."""
    committed = step_folders(ckpt_dir)
    _, ignored = scan_checkpoints(ckpt_dir)
    for path in ignored:
        if path not in committed:
            warn(f"ignoring {path}: not a committed checkpoint (left by an interrupted save)")
    if not committed:
        return None
    try:
        return verify_checkpoint(committed[-1], checksums=checksums)
    except CheckpointError as exc:
        if len(committed) > 1:
            hint = (f"; the previous checkpoint is {committed[-2]}: move {committed[-1].name} out of "
                    f"{ckpt_dir} (for example rename it to {committed[-1].name}.bad) and resume again")
        else:
            hint = ("; no earlier checkpoint exists: start without --resume in a new folder (--out), "
                    "or move this one aside")
        raise CheckpointError(f"{exc}{hint}") from None


def _write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    """Write ``manifest.json`` into ``folder`` atomically: temp name, fsync, rename, fsync."""
    staging = folder / f"{MANIFEST}.partial"
    with staging.open("w") as handle:
        json.dump(manifest, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    staging.rename(folder / MANIFEST)
    fsync_dir(folder)


def commit_checkpoint(tmp: Path, final: Path, *, step: int, consumed_samples: int,
                      plan: dict[str, Any], files: dict[str, dict[str, Any]] | None = None,
                      fingerprint: dict[str, Any] | None = None) -> None:
    """Write the manifest into ``tmp`` and rename it to ``final``. ``files`` are the records the
    ranks reported for the files they wrote; any other file in ``tmp`` is hashed here."""
    reported = dict(files or {})
    present = {str(file.relative_to(tmp)): file for file in sorted(tmp.rglob("*")) if file.is_file()}
    missing = sorted(set(reported) - set(present))
    if missing:
        raise CheckpointError(f"a rank reported {', '.join(missing)} in {tmp}, but it is not there")
    listed = {name: reported.get(name) or file_record(file) for name, file in present.items()}
    _write_manifest(tmp, {"step": step, "consumed_samples": consumed_samples, "plan": plan,
                          "fingerprint": fingerprint, "files": listed})
    if final.exists():  # a resumed run saves a step again: swap, then drop the old folder
        old = final.with_name(f"{final.name}.old-{uuid.uuid4().hex[:8]}")
        final.rename(old)
        tmp.rename(final)
        fsync_dir(final.parent)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
        fsync_dir(final.parent)


def prune_checkpoints(ckpt_dir: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` committed checkpoints; returns the deleted folders."""
    complete, _ = scan_checkpoints(ckpt_dir)
    doomed = complete[:-keep] if keep > 0 else []
    for path in doomed:
        shutil.rmtree(path)
    return doomed


def remove_interrupted_saves(ckpt_dir: Path) -> list[Path]:
    """Delete the ``.tmp-`` folders of saves cut short (a rank or the job killed mid-save), once
    a newer save has committed: the run holds the folder's lock, so no other save is under way,
    and such a folder is never loaded. Returns the deleted folders."""
    doomed = sorted(entry for entry in ckpt_dir.iterdir()
                    if entry.name.startswith(PREFIX) and TMP_INFIX in entry.name)
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


# --- torch side: what is saved and loaded ---------------------------------------------------
def _engine_state(engine: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    model: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    for part, optimizers in zip(engine.model_parts, part_optimizers(engine), strict=True):
        model.update(get_model_state_dict(part))
        optim.update(get_optimizer_state_dict(part, optimizers, options=flat))
    return {"model": model, "optim": optim}


def part_optimizers(engine: Any) -> list[list[Any]]:
    """The optimizers of each model part: one per part, or the engine's ``part_optimizers``
    where it keeps several over one part (a layerwise plan: one per mesh and kind of parameter);
    their state goes into one state dict keyed by the parameters' fully-qualified names."""
    grouped = getattr(engine, "part_optimizers", None)
    if grouped is not None:
        return [list(optimizers) for optimizers in grouped]
    if len(engine.model_parts) != len(engine.optimizers):
        raise CheckpointError(
            f"checkpoints need one optimizer per model part (or the engine's part_optimizers), "
            f"the engine has {len(engine.model_parts)} parts and {len(engine.optimizers)} "
            "optimizers"
        )
    return [[optimizer] for optimizer in engine.optimizers]


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


def _gather_to_rank0(value: Any) -> list[Any]:
    import torch.distributed as dist

    if not _distributed():
        return [value]
    rank, world = _rank_world()
    out: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(value, out, dst=0)
    return out or []


def own_files(folder: Path, rank: int) -> list[Path]:
    """The files one rank wrote into a checkpoint folder: its DCP shards (``__<rank>_*``), its
    ``extra-rank<rank>.pt``, and on rank 0 the DCP ``.metadata``."""
    names = [f"__{rank}_", f"extra-rank{rank}.pt"] + ([".metadata"] if rank == 0 else [])
    return [file for file in sorted(folder.iterdir()) if file.is_file()
            and any(file.name == n or (n.endswith("_") and file.name.startswith(n)) for n in names)]


def save_checkpoint(engine: Any, ckpt_dir: Path, *, step: int, consumed_samples: int,
                    plan: dict[str, Any], keep: int,
                    fingerprint: dict[str, Any] | None = None) -> Path:
    """Save on every rank (collective); returns the committed ``step-N`` folder."""
    import torch
    import torch.distributed.checkpoint as dcp

    rank, _ = _rank_world()
    tmp = ckpt_dir / f"{PREFIX}{step}{TMP_INFIX}{_from_rank0(uuid.uuid4().hex[:12])}"
    if rank == 0:
        tmp.mkdir(parents=True)
    _barrier()
    dcp.save(_engine_state(engine), checkpoint_id=str(tmp), no_dist=not _distributed())
    extra = tmp / f"extra-rank{rank}.pt"
    torch.save(_extra_state(engine), extra)
    with extra.open("rb") as handle:
        os.fsync(handle.fileno())
    fault.point("checkpoint", step)  # MESHMORPH_FAULT (tests): this rank's files are written
    _barrier()  # every rank's files are on disk (rank 0's .metadata last of all)
    mine = {file.name: file_record(file) for file in own_files(tmp, rank)}  # each rank hashes its own
    reports = _gather_to_rank0(mine)
    final = ckpt_dir / f"{PREFIX}{step}"
    if rank == 0:
        files = {name: record for report in reports for name, record in report.items()}
        commit_checkpoint(tmp, final, step=step, consumed_samples=consumed_samples, plan=plan,
                          files=files, fingerprint=fingerprint)
        prune_checkpoints(ckpt_dir, keep)  # only once the new one is committed
        remove_interrupted_saves(ckpt_dir)
    _barrier()  # nobody runs ahead (or exits) before the commit
    return final


TIED_HEAD = "head.out.weight"
TIED_EMBEDDING = "embed.tok.weight"


def _saved_keys(path: Path) -> set[str]:
    import torch.distributed.checkpoint as dcp

    return set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def tied_aliases(section: str, keys: list[str], saved: set[str]) -> dict[str, str]:
    """Keys of ``section`` to read under another name: a pipeline head's own copy of a tied
    embedding (``head.out.weight``) that a checkpoint saved without pipeline parallelism holds
    only as the embedding (``embed.tok.weight``), which is what it was tied to."""
    aliases = {}
    for key in keys:
        if TIED_HEAD not in key or f"{section}.{key}" in saved:
            continue
        other = key.replace(TIED_HEAD, TIED_EMBEDDING)
        if f"{section}.{other}" in saved and other not in keys:
            aliases[key] = other
    return aliases


def load_checkpoint(engine: Any, info: CheckpointInfo) -> None:
    """Load model, optimizer, LR scheduler and (same world size only) RNG states (collective).
    The Plan may differ from the one that saved: DCP reshards, and a pipeline head's copy of a
    tied embedding is read from the embedding a checkpoint without pipeline parallelism holds."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    rank, world = _rank_world()
    state = _engine_state(engine)
    saved = _saved_keys(info.path)
    renamed = {section: tied_aliases(section, list(values), saved)
               for section, values in state.items()}
    request = {section: {renamed[section].get(key, key): value for key, value in values.items()}
               for section, values in state.items()}
    dcp.load(request, checkpoint_id=str(info.path), no_dist=not _distributed())
    state = {section: {key: request[section][renamed[section].get(key, key)] for key in values}
             for section, values in state.items()}
    for part, optimizers in zip(engine.model_parts, part_optimizers(engine), strict=True):
        set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
        set_optimizer_state_dict(part, optimizers, state["optim"],
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
