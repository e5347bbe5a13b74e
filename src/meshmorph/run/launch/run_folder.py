"""The run folder: refused when it holds another run, locked while a run uses it.

A run without ``--resume`` never starts in a folder that holds checkpoints (it would mix two runs
and prune one of them), and a run with ``--resume`` never starts where no checkpoint lies (a typo
in ``--out`` would start a new run from step 0 that the user takes for the old one). While a run
is going, an exclusive lock on ``.meshmorph.lock`` (held by the launcher and inherited by
torchrun) keeps a second run out; the refusal names the holder's pid.
The nodes of one multi-node ``--elastic`` run share the run folder (shared storage, or one
machine standing in for several): node 0 owns it (the checks of a new run, the earlier run's
records, ``plan.json``, the lock above), node K > 0 joins it under a lock of its own,
``.meshmorph.node-K.lock``, its ranks reading the plan from ``.meshmorph.node-K.plan.json``.
The launcher asks the ranks to stop by creating ``.meshmorph.stop``: they look for it at every
step boundary, so a request made while they are still starting is not lost.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from meshmorph.run.checkpoint import PREFIX, scan_checkpoints, step_folders
from meshmorph.run.launch.console import LOG_FOLDER
from meshmorph.run.metrics import LOSS_CHART, METRICS_FILE

LOCK_FILE = ".meshmorph.lock"
STOP_FILE = ".meshmorph.stop"


def lock_file(node: int | None = None) -> str:
    """The lock's name for a plain run or node 0 (``LOCK_FILE``), or for node ``node`` > 0 of a
    multi-node run sharing the folder."""
    return LOCK_FILE if not node else f".meshmorph.node-{node}.lock"


def plan_file(node: int | None = None) -> str:
    """Where the launcher writes the plan its ranks read: ``plan.json`` (a plain run, node 0),
    or for node ``node`` > 0 a file of its own, removed when it ends (``plan.json`` is node 0's
    record, which it may set aside as an earlier run's while node K starts)."""
    return "plan.json" if not node else f".meshmorph.node-{node}.plan.json"


class RunFolderError(ValueError):
    """A run folder that cannot take this run: the message names the folder and a way out."""


def check_fresh(out_dir: Path, ckpt_dir: Path) -> None:
    """Refuse to start a new run (no ``--resume``) where checkpoints of a run already lie."""
    if not ckpt_dir.is_dir():
        return
    found = sorted(entry.name for entry in ckpt_dir.iterdir() if entry.name.startswith(PREFIX))
    if found:
        shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
        raise RunFolderError(
            f"run folder {out_dir} holds checkpoints of an earlier run ({shown} in {ckpt_dir}); "
            f"continue that run with --resume, or start a new one in another folder (--out NEW); "
            f"nothing in it was changed"
        )


def check_resumable(out_dir: Path, ckpt_dir: Path) -> None:
    """Refuse ``--resume`` where no checkpoint lies (``step-N`` folders are then verified by
    ``latest_checkpoint``): it would start from step 0 while the user believes it continues."""
    if step_folders(ckpt_dir):
        return
    way_out = "check --out (or [run] out_dir), or run without --resume to start from step 0"
    if not out_dir.exists():
        raise RunFolderError(f"--resume: run folder {out_dir} does not exist, so there is no "
                             f"checkpoint to continue from; {way_out}")
    _, cut = scan_checkpoints(ckpt_dir)
    only = (f" (only saves cut short, never loaded: {', '.join(p.name for p in cut[:3])}"
            + (f" and {len(cut) - 3} more" if len(cut) > 3 else "") + ")") if cut else ""
    raise RunFolderError(f"--resume: run folder {out_dir} holds no checkpoint to continue from "
                         f"(searched {ckpt_dir}{only}); {way_out}; nothing in it was changed")


EARLIER_RECORDS = (METRICS_FILE, "plan.json", LOSS_CHART, "trace.json", LOG_FOLDER)
"""What a run writes into its folder besides checkpoints: a new run (no ``--resume``) in a folder
that holds them but no checkpoint moves them aside (``set_aside_earlier_run``)."""


def set_aside_earlier_run(out_dir: Path) -> Path | None:
    """Move an earlier run's records (``EARLIER_RECORDS``) into ``out_dir/earlier-N/`` (N the
    first number free) so that a new run neither mixes with them nor wipes them; the folder
    they went to, or None when there were none."""
    found = [out_dir / name for name in EARLIER_RECORDS if (out_dir / name).exists()]
    if not found:
        return None
    number = 1
    while (out_dir / f"earlier-{number}").exists():
        number += 1
    aside = out_dir / f"earlier-{number}"
    aside.mkdir()
    for path in found:
        path.rename(aside / path.name)
    return aside


def make_folder(out_dir: Path) -> None:
    """Create the run folder, or say why it cannot be."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise RunFolderError(f"run folder {out_dir} is a file; choose another --out") from None
    except OSError as exc:
        raise RunFolderError(
            f"cannot create run folder {out_dir} ({exc.strerror}); choose a writable --out"
        ) from None
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise RunFolderError(f"run folder {out_dir} is not writable; choose a writable --out")


class RunLock:
    """An exclusive, non-blocking lock on the run folder for the lifetime of a run."""

    def __init__(self, out_dir: Path, node: int | None = None) -> None:
        self.path = out_dir / lock_file(node)
        self.fd: int | None = None

    def acquire(self) -> RunLock:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise RunFolderError(
                f"cannot create the lock file {self.path} ({exc.strerror}); choose a writable --out"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunFolderError(
                f"run folder {self.path.parent} is in use by another meshmorph run (pid {holder}, "
                f"lock {self.path}); wait for it to finish or stop it, or use another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        """Remove the lock file (a finished run leaves none) while still holding it, so a run
        that opened it meanwhile is refused rather than locking a removed file; then unlock."""
        if self.fd is not None:
            with contextlib.suppress(OSError):
                self.path.unlink()
            with contextlib.suppress(OSError):
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def stop_file(out_dir: Path) -> Path:
    return out_dir / STOP_FILE


def request_stop(out_dir: Path) -> None:
    """Ask the ranks of the run in ``out_dir`` to stop at their next step boundary."""
    with contextlib.suppress(OSError):
        stop_file(out_dir).touch()


def clear_stop(out_dir: Path) -> None:
    stop_file(out_dir).unlink(missing_ok=True)
