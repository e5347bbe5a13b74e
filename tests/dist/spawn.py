"""Run a function on N real gloo processes on CPU, with a hard timeout.

``spawn(fn, world_size, args, timeout_s)`` starts N spawned processes, each with its stdout and
stderr (file descriptors included, so C++ logs too) written to its own log file, one process
group created once per job, ``torch.set_num_threads(1)``. On the first rank that fails, or at the
timeout, every rank still running is killed and ``SpawnError`` carries every rank's output.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any


class SpawnError(RuntimeError):
    """A rank failed or the job ran past its timeout; the message holds every rank's output."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, port: int, log: str,
               args: tuple[Any, ...], collective_timeout_s: float) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=collective_timeout_s))
        fn(rank, world_size, *args)
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        os._exit(1)  # do not wait on peers that may be stuck in a collective
    os._exit(0)


def _outputs(logs: list[str]) -> str:
    parts = []
    for rank, log in enumerate(logs):
        text = Path(log).read_text(errors="replace") if os.path.exists(log) else ""
        parts.append(f"----- rank {rank} -----\n{text[-20000:]}")
    return "\n".join(parts)


def spawn(fn: Callable[..., Any], world_size: int, args: tuple[Any, ...] = (), *,
          timeout_s: float = 300.0, collective_timeout_s: float = 120.0) -> list[str]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; returns each rank's
    output. ``fn`` must be importable (a module-level function)."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="spawn-") as tmp:
        logs = [os.path.join(tmp, f"rank{r}.log") for r in range(world_size)]
        procs = [ctx.Process(target=_rank_main, daemon=True,
                             args=(fn, r, world_size, port, logs[r], args, collective_timeout_s))
                 for r in range(world_size)]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout_s
        failure = None
        while True:
            codes = [proc.exitcode for proc in procs]
            bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                failure = "; ".join(f"rank {r} exited with code {codes[r]}" for r in bad)
                break
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                failure = f"timed out after {timeout_s:.0f} s (ranks still running: " \
                          f"{[r for r, c in enumerate(codes) if c is None]})"
                break
            time.sleep(0.05)
        for proc in procs:
            if proc.exitcode is None:
                proc.kill()  # only the processes this call started
            proc.join(timeout=10)
        output = _outputs(logs)
        if failure:
            raise SpawnError(f"{failure}\n{output}")
        return [Path(log).read_text(errors="replace") for log in logs]
