"""Bad input through the real command line, in this process: ``refused`` runs ``meshmorph ARGS``
and asserts exit code 2 with one traceback-free ``meshmorph: error: `` line naming every needle;
``arg_refused`` does the same for a flag argparse itself refuses (its usage, then one error line);
``forbid_processes`` makes any started process (subprocess or multiprocessing) fail the test."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from meshmorph.cli import main as cli_main

BINARY = bytes(range(256)) * 4
"""Bytes no text file holds (every byte value, NUL and invalid UTF-8 among them)."""


def forbid_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if bad input starts a process: torchrun, a profiler rank, anything."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a process was started although the input was bad")

    monkeypatch.setattr("subprocess.Popen", refuse)
    monkeypatch.setattr("multiprocessing.process.BaseProcess.start", refuse)
    monkeypatch.delenv("MASTER_PORT", raising=False)


def refused(capsys: pytest.CaptureFixture, args: list[str], *needles: str) -> str:
    """Run ``meshmorph ARGS``; it must exit 2 with every needle in one traceback-free message."""
    code = cli_main(args)
    captured = capsys.readouterr()
    err = captured.err
    assert code == 2, f"exit {code}\nstdout:\n{captured.out[-2000:]}\nstderr:\n{err}"
    assert err.startswith("meshmorph: error: ") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"
    assert "Traceback" not in err + captured.out
    return err


def arg_refused(capsys: pytest.CaptureFixture, args: list[str], *needles: str) -> str:
    """Run ``meshmorph ARGS`` whose flag argparse refuses: exit 2, the usage, then one error line
    naming the flag and every needle."""
    with pytest.raises(SystemExit) as exit_info:
        cli_main(args)
    captured = capsys.readouterr()
    assert exit_info.value.code == 2, captured.err
    last = captured.err.strip().splitlines()[-1]
    assert last.startswith("meshmorph") and ": error: " in last, captured.err
    for needle in needles:
        assert needle in last, f"{needle!r} not in {last!r}"
    assert "Traceback" not in captured.err + captured.out
    return last


def write(path: Path, content: str | bytes | dict[str, Any] | list[Any]) -> Path:
    """``content`` into ``path``: bytes as they are, text as UTF-8, anything else as JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, str):
        path.write_text(content)
    else:
        path.write_text(json.dumps(content))
    return path
