"""Ctrl-C or SIGTERM while torchrun still waits for its rendezvous (no rank started yet): the
launcher stops it at once instead of waiting for ranks that do not exist to finish a step. Once
the ranks run, the first Ctrl-C says which step they finish and how long it should take still,
and a second one kills every process below torchrun at once."""

from __future__ import annotations

import json
import os
import subprocess
import time
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

from meshmorph.run.job import parse_job
from meshmorph.run.launch.launcher import _watch, descendants, stopping_line
from meshmorph.run.launch.run_folder import STOP_FILE
from meshmorph.run.metrics import METRICS_FILE
from tests.helpers.jobs import gpt_tiny_job


def test_an_interrupt_before_any_rank_started_stops_torchrun_at_once() -> None:
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)  # torchrun, no workers
    wait, interrupted = proc.wait, []

    def first_wait_interrupted(timeout: float | None = None) -> int:
        if not interrupted:
            interrupted.append(True)
            raise KeyboardInterrupt
        return wait(timeout)

    proc.wait = first_wait_interrupted  # type: ignore[method-assign]
    started = time.monotonic()
    code, how, _ = _watch(SimpleNamespace(), proc)  # type: ignore[arg-type]
    assert how == "not started" and code is not None and proc.poll() is not None
    assert time.monotonic() - started < 10


def _run(tmp_path: Path, *, every: int = 2) -> SimpleNamespace:
    job = parse_job(tomllib.loads(gpt_tiny_job(checkpoint={"every": every})))
    return SimpleNamespace(out_dir=tmp_path, job=job)


def _metrics(tmp_path: Path, step: int, step_time_s: float, age_s: float) -> None:
    path = tmp_path / METRICS_FILE
    path.write_text(json.dumps({"step": step, "loss": 1.0, "step_time_s": step_time_s}) + "\n"
                    + json.dumps({"event": "state", "after_step": 1}) + "\n")
    when = time.time() - age_s
    os.utime(path, (when, when))


def test_the_first_ctrl_c_names_the_step_it_finishes_and_how_long_it_should_take(
        tmp_path: Path) -> None:
    run = _run(tmp_path)
    _metrics(tmp_path, 57, 40.0, 15.0)  # a long step, 15 s under way
    line, left = stopping_line(run, tmp_path / "checkpoints" / "step-50", time.time())  # type: ignore[arg-type]
    assert 24 < left <= 25, left
    assert line.startswith("stopping: the ranks finish step 58 (about 25 s more: the last step "
                           "took 40 s), save a checkpoint, and exit; press Ctrl-C again to stop "
                           "at once (the newest checkpoint, step-50, is kept)"), line
    _metrics(tmp_path, 3, 0.08, 12.0)  # overdue: a step far longer than the last one
    line, left = stopping_line(run, None, time.time())  # type: ignore[arg-type]
    assert left == 0 and "finish step 4 (running 12 s, longer than the last step's 0.1 s)" in line
    assert "(no checkpoint is saved yet)" in line
    (tmp_path / "checkpoints" / "step-3.tmp-0123abcd").mkdir(parents=True)  # saving step 3
    line, left = stopping_line(run, None, time.time())  # type: ignore[arg-type]
    assert left == 0 and line.startswith("stopping: the ranks finish saving step 3's checkpoint "
                                          "and exit; press Ctrl-C again to stop at once"), line
    (tmp_path / METRICS_FILE).unlink()  # the first step still runs
    line, _ = stopping_line(_run(tmp_path, every=0), None, time.time())  # type: ignore[arg-type]
    assert line == ("stopping: the ranks finish step 1 (its length is unknown: no step has "
                    "finished yet), and exit; press Ctrl-C again to stop at once (no checkpoint "
                    "is saved yet)")


def test_a_second_ctrl_c_kills_every_process_below_torchrun_at_once(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # torchrun with two ranks, both in the middle of a step that would last a minute
    proc = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60 & wait"], start_new_session=True)
    wait_until = time.monotonic() + 10
    while len(descendants(proc.pid)) < 2 and time.monotonic() < wait_until:
        time.sleep(0.05)
    ranks = descendants(proc.pid)
    _metrics(tmp_path, 3, 50.0, 1.0)
    wait, calls = proc.wait, []

    def interrupted_twice(timeout: float | None = None) -> int:
        calls.append(timeout)
        if len(calls) <= 2:
            raise KeyboardInterrupt
        return wait(timeout)

    proc.wait = interrupted_twice  # type: ignore[method-assign]
    started = time.monotonic()
    code, how, _ = _watch(_run(tmp_path), proc)  # type: ignore[arg-type]
    assert how == "aborted" and code == -9 and time.monotonic() - started < 5
    assert calls[1] is not None and calls[1] > 300 + 45  # the grace counts the step's rest too
    assert not [pid for pid in ranks if Path(f"/proc/{pid}").exists()
                and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "finish step 4 (about 49 s more" in err, err
    assert (tmp_path / STOP_FILE).exists()  # asked first; launch() clears it on the way out
