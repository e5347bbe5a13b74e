"""The command-line test helper kills what a test left running (tests/helpers/cli.py)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from tests.helpers import cli


def test_a_run_a_test_left_running_is_killed_and_one_that_ended_is_not_counted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "_command", lambda args, nice: [
        sys.executable, "-c", f"import time; time.sleep({args[0]})"])
    done = cli.start_cli(["0"], tmp_path / "done.log")
    done.wait(30)
    hung = cli.start_cli(["60"], tmp_path / "hung.log")
    assert hung.poll() is None
    assert cli.kill_left_over() == 1
    assert hung.poll() is not None and threading.get_ident() not in cli.STARTED
    assert cli.kill_left_over() == 0
