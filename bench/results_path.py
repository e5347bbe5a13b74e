"""Where the bench scripts write their results: a new file by default, the committed figures only
when asked.

Each script declares the committed files it produces (``Outputs("bench/results/x.json")``) and
adds two flags to its parser:

- no flag: each file goes to ``bench/results/latest/`` under its own name (ignored by git), so
  a run never changes the committed results;
- ``--out PATH``: that file, or with several files a folder that receives them all;
- ``--update``: rewrite the committed files (the only way they change).

Scripts are run as ``python bench/NAME.py``, so this sibling module imports as ``results_path``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
"""The committed results."""
LATEST = RESULTS / "latest"
"""Where a run writes by default (in .gitignore)."""


class Outputs:
    """The committed files one bench script writes, as paths relative to the repository root
    (``bench/results/...``, or a chart under ``docs/img/``); the first is its main result."""

    def __init__(self, *committed: str) -> None:
        if not committed:
            raise ValueError("a script writes at least one file")
        names = [Path(c).name for c in committed]
        if len(set(names)) != len(names):
            raise ValueError(f"two outputs share a file name: {committed}")
        self.committed = tuple(committed)

    @property
    def several(self) -> bool:
        return len(self.committed) > 1

    def add_args(self, parser: argparse.ArgumentParser) -> None:
        """``--out PATH`` and ``--update`` (one or the other)."""
        names = ", ".join(Path(c).name for c in self.committed)
        group = parser.add_mutually_exclusive_group()
        group.add_argument(
            "--out", type=Path, default=None, metavar="DIR" if self.several else "PATH",
            help=(f"folder for {names}" if self.several else f"write {names} here")
            + f" (default {LATEST.relative_to(ROOT)}/)")
        group.add_argument(
            "--update", action="store_true",
            help=f"rewrite the committed {', '.join(self.committed)}")

    def _find(self, name: str | None) -> str:
        if name is None:
            return self.committed[0]
        for committed in self.committed:
            if Path(committed).name == name:
                return committed
        raise KeyError(f"{name} is not one of {self.committed}")

    def committed_path(self, name: str | None = None) -> Path:
        """The committed file ``name`` (default: the main result), for reading."""
        return ROOT / self._find(name)

    def target(self, args: argparse.Namespace, name: str | None = None) -> Path:
        """Where ``name`` (default: the main result) goes for these arguments."""
        committed = self._find(name)
        file = Path(committed).name
        if args.update:
            return ROOT / committed
        if args.out is not None:
            return args.out / file if self.several else args.out
        return LATEST / file

    def path(self, args: argparse.Namespace, name: str | None = None) -> Path:
        """``target``, with its folder created."""
        path = self.target(args, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def paths(self, args: argparse.Namespace) -> dict[str, Path]:
        """Every file's path, by file name."""
        return {Path(c).name: self.path(args, Path(c).name) for c in self.committed}


def shown(path: Path) -> str:
    """``path`` relative to the working folder when it lies below it."""
    try:
        return os.path.relpath(path) if path.resolve().is_relative_to(Path.cwd()) else str(path)
    except ValueError:
        return str(path)


def wrote(*paths: Path) -> None:
    """Print the files written."""
    print("wrote " + ", ".join(shown(p) for p in paths))
