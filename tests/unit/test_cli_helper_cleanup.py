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


def test_a_failed_wait_leaves_the_run_to_the_cleanup(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "_command", lambda args, nice: [
        sys.executable, "-c", "import time; time.sleep(60)"])
    proc = cli.start_cli([], tmp_path / "log")
    with pytest.raises(pytest.fail.Exception, match="waited 0 s; the launcher was still running"):
        cli.wait_for(lambda: False, proc, tmp_path / "log", 0.3)
    assert proc.poll() is None and cli.kill_left_over() == 1 and proc.poll() is not None
