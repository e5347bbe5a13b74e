"""Output files of the subcommands: refuse an unwritable path before any work is done, write
JSON with a one-line error a user can act on."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def unwritable(path: Path, exc: OSError, flag: str) -> ValueError:
    reason = exc.strerror or str(exc)
    return ValueError(f"cannot write {path} ({reason}); pass a writable path to {flag}")


def write_json(path: Path, data: Any, flag: str = "--json") -> None:
    """Write ``data`` as indented JSON to ``path`` (creating its folder)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2) + "\n")
    except OSError as exc:
        raise unwritable(path, exc, flag) from None


def check_writable(path: Path | None, flag: str) -> None:
    """Refuse an output path that cannot be written, before any work is done."""
    if path is None:
        return
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a folder; pass a file path")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: {parent} is not a folder; pass a writable path")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ValueError(f"cannot write {path} (permission denied); pass a writable path to {flag}")
