"""Ctrl-C or SIGTERM while torchrun still waits for its rendezvous (no rank started yet): the
launcher stops it at once instead of waiting for ranks that do not exist to finish a step."""

from __future__ import annotations

import subprocess
import time
from types import SimpleNamespace

from meshmorph.run.launch.launcher import _watch


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
