"""``meshmorph`` on the command line, as a user runs it: started in a process of its own (its
own session, so a test can signal the whole tree like a terminal's Ctrl-C), waited for with a
timeout past which every process it started is killed and the test fails with its output, and
its run folder read back."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from meshmorph.run.launch.launcher import descendants

_POPEN = subprocess.Popen
"""``subprocess.Popen`` as it was when the suite started. The background jobs start their runs
through it while the foreground tests go on, and some of those tests replace
``subprocess.Popen`` for a moment to show that bad input starts no process: a run the
background starts then must neither fail nor count as one the test's command started."""
ENVIRONMENT = dict(os.environ)
"""The environment as it was when the suite started: what every command started here gets (plus
what its caller adds), not what a foreground test set for a moment (``MASTER_PORT``...)."""


def _command(args: list[str], nice: int) -> list[str]:
    """``meshmorph ARGS``; with ``nice``, under ``nice -n NICE`` (every process it starts
    inherits the priority)."""
    command = [sys.executable, "-m", "meshmorph", *args]
    tool = shutil.which("nice") if nice else None
    return [tool, "-n", str(nice), *command] if tool else command


def _popen(args: list[str], nice: int, **kwargs: object) -> subprocess.Popen[str]:
    """``meshmorph ARGS`` started in a new session (``nice``: see ``_command``). Where Linux
    groups the CPU by session (``sched_autogroup``), the new session is a group of its own and
    the groups share the CPU first, whatever their processes' nice: the group's own nice is set
    too, or a run in the background would take as much CPU as a foreground test's run."""
    proc = _POPEN(_command(args, nice), text=True, start_new_session=True,
                  **kwargs)  # type: ignore[call-overload]
    if nice:
        with contextlib.suppress(OSError):  # no autogroups here: the process nice serves alone
            Path(f"/proc/{proc.pid}/autogroup").write_text(str(nice))
    return proc


STARTED: dict[int, list[subprocess.Popen[str]]] = {}
"""The launchers ``start_cli`` started, by the thread that started them: those still running
are killed when the foreground test or the background job that started them ends
(``kill_left_over``), never another thread's."""


def start_cli(args: list[str], log: Path, env: Mapping[str, str] | None = None, *,
              nice: int = 0) -> subprocess.Popen[str]:
    """``meshmorph ARGS`` started in a new session, stdout and stderr into ``log``; ``nice``:
    its CPU priority increment (for runs in the background of the session)."""
    proc = _popen(args, nice, stdout=log.open("w"), stderr=subprocess.STDOUT,
                  env=dict(ENVIRONMENT if env is None else env))
    STARTED.setdefault(threading.get_ident(), []).append(proc)
    return proc


def kill_left_over() -> int:
    """Kill every run this thread started that still runs (a test that failed before stopping
    its run would leave it training beside the rest of the suite); how many there were."""
    left = [proc for proc in STARTED.pop(threading.get_ident(), []) if proc.poll() is None]
    for proc in left:
        kill_tree(proc)
        proc.wait()
    return len(left)


def kill_tree(proc: subprocess.Popen[str]) -> None:
    """SIGKILL ``proc`` and every process below it (only those: this test started them)."""
    for pid in [*descendants(proc.pid), proc.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def finish(proc: subprocess.Popen[str], log: Path, timeout_s: float) -> int:
    """Wait for the launcher; past the timeout kill everything it started and fail with the
    output of every rank."""
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        proc.wait()
        pytest.fail(f"meshmorph ran past {timeout_s} s; output:\n{log.read_text()}")


TORCH_LOAD_FAILURE = "Intel oneMKL FATAL ERROR: Cannot load"
"""What torch's CPU build prints, and exits 2 with, when a fresh process fails to load its own
``libtorch_cpu.so`` (the MKL inside it loads that library again): seen now and then in a suite of
hundreds of processes, before meshmorph printed anything, and gone when the run started again."""


def run_cli(args: list[str], *, timeout_s: float = 120, nice: int = 0) -> tuple[int, str]:
    """``meshmorph ARGS`` to its end: exit code and output (every rank's lines come through
    torchrun); past the timeout every process it started is killed and the test fails. A run
    that printed nothing but ``TORCH_LOAD_FAILURE`` is started once more."""
    for attempt in (1, 2):
        proc = _popen(args, nice, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                      env=ENVIRONMENT)
        try:
            output, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            output, _ = proc.communicate()
            pytest.fail(f"meshmorph {' '.join(args)} ran past {timeout_s} s; output:\n{output}")
        if attempt == 2 or not output.strip().startswith(TORCH_LOAD_FAILURE):
            break
    return proc.returncode, output


def records(run_dir: Path) -> list[dict]:
    """The step lines of a run folder's ``metrics.jsonl`` (events left out); none yet: []."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [row for row in rows if "event" not in row]


def events(run_dir: Path, kind: str | None = None) -> list[dict]:
    """The event lines of a run folder's ``metrics.jsonl`` (of ``kind`` only, if given)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
    return [row for row in rows if "event" in row and kind in (None, row["event"])]


def steps_done(run_dir: Path) -> int:
    """The newest step a run folder's metrics name (0 before the first)."""
    return max((row["step"] for row in records(run_dir)), default=0)


def wait_for(predicate: Callable[[], bool], proc: subprocess.Popen[str], log: Path,
             timeout_s: float = 120) -> None:
    """Poll ``predicate`` until it holds; fails (with the output) if the launcher ended or
    ``timeout_s`` passed first (the run is then killed with whatever else the test or background
    job left running: ``kill_left_over``)."""
    deadline = time.monotonic() + timeout_s
    while not predicate() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    if proc.poll() is None and predicate():
        return
    ended = proc.poll()
    pytest.fail(f"waited {timeout_s:.0f} s; the launcher "
                + ("was still running" if ended is None else f"exited {ended}")
                + f"; output:\n{log.read_text()}")


def command_line(pid: int) -> str:
    """The command line of process ``pid`` ("" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@dataclass(frozen=True)
class ExampleRun:
    """``meshmorph run --config examples/jobs/text-file.toml --nproc 2``, run to its end."""

    job: Path
    """The committed job file."""
    run_dir: Path
    """Its run folder (metrics, plan, two checkpoints): copy it before changing anything."""
    output: str
    """Everything the launcher and the ranks printed."""
    code: int
    """The launcher's exit code."""
    port: int
    """The free port given as ``MASTER_PORT``."""
    agent_command: str
    """The torchrun agent's command line, read while the job ran."""

    def copy_to(self, folder: Path) -> Path:
        """A copy of the run folder under ``folder`` (the tests that resume it change it)."""
        assert self.code == 0, self.output
        return Path(shutil.copytree(self.run_dir, folder / "run"))
