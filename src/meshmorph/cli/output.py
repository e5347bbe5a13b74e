"""Output files of the subcommands: every flag that names a file to write is declared with
``add_output``, and ``check_outputs`` (called by cli/app.py before any subcommand runs) refuses an
unwritable path before any work is done; JSON is written with a one-line error a user can act on."""

from __future__ import annotations

import argparse
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


def add_output(parser: argparse.ArgumentParser, flag: str, help: str, **kwargs: Any) -> None:
    """A flag naming a file the subcommand writes (checked writable before the work starts)."""
    kwargs.setdefault("metavar", "FILE")
    parser.add_argument(flag, type=Path, default=kwargs.pop("default", None), help=help, **kwargs)
    parser.set_defaults(output_flags=(*(parser.get_default("output_flags") or ()), flag))


def check_outputs(args: argparse.Namespace) -> None:
    """Refuse any output flag of the parsed subcommand whose path cannot be written, before any
    work is done."""
    for flag in getattr(args, "output_flags", ()):
        path = getattr(args, flag.lstrip("-").replace("-", "_"))
        if path is None:
            continue
        if path.is_dir():
            raise ValueError(f"{flag} {path} is a folder; pass a file path")
        parent = path.parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        if not parent.is_dir():
            raise ValueError(f"{flag} {path}: {parent} is not a folder; pass a writable path")
        if not os.access(parent, os.W_OK | os.X_OK) or (path.exists()
                                                         and not os.access(path, os.W_OK)):
            raise ValueError(f"cannot write {path} (permission denied); pass a writable path "
                             f"to {flag}")


def finish(parser: argparse.ArgumentParser, func: Any, *, wide: bool = True, **files: str) -> None:
    """The last flags of a subcommand and the function that runs it: ``--NAME FILE`` for each
    ``NAME=help`` of ``files`` (``add_output``), then ``--wide`` (unless not ``wide``): every
    table column with its full header, at any width (the tables otherwise fit 100 columns;
    meshmorph.tables)."""
    for name, help in files.items():
        add_output(parser, f"--{name}", help=help)
    if wide:
        parser.add_argument("--wide", action="store_true",
                            help="print every table column unabbreviated, however wide (default: "
                                 "tables fit 100 columns, on a terminal and piped alike)")
    parser.set_defaults(func=func)
