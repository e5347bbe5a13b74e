"""Run a function on N local processes with a hard timeout: gloo on CPU, or NCCL with one GPU
per rank where CUDA is present (``backend="auto"``).

Each rank's stdout and stderr (file descriptors included, so C++ logs too) go to its own log
file; one process group is created once per job. On the first rank that fails, or at the
timeout, every rank still running is killed and ``SpawnError`` carries every rank's output.
The profile and validate jobs and the multi-process tests and benchmarks all start processes
through this one function.
"""

from __future__ import annotations

import contextlib
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

LOG_TAIL_CHARS = 20000
"""Characters of each rank's log a SpawnError shows (the end of it)."""


class SpawnError(RuntimeError):
    """A rank failed or the job ran past its timeout; the message holds every rank's output."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, port: int, log: str,
               args: tuple[Any, ...], threads: int, backend: str,
               collective_timeout_s: float, nice: int = 0) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      OMP_NUM_THREADS=str(threads))
    if nice:
        try:  # a negative increment needs privilege; without it the rank runs at its priority
            os.nice(nice)
        except PermissionError:
            print(f"meshmorph: could not change the priority by {nice} (no privilege)", flush=True)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, rank=rank, world_size=world_size,
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
        parts.append(f"----- rank {rank} -----\n{text[-LOG_TAIL_CHARS:]}")
    return "\n".join(parts)


def spawn(fn: Callable[..., Any], world_size: int, args: tuple[Any, ...] = (),
          log_dir: Path | None = None, *, timeout_s: float = 300.0, threads: int = 1,
          backend: str = "auto", collective_timeout_s: float = 300.0,
          poll: Callable[[], None] | None = None, nice: int = 0) -> list[str]:
    """Run ``fn(rank, world_size, *args)`` (a module-level function) on ``world_size``
    processes and return each rank's output. ``log_dir``: where the rank logs go (default: a
    temporary folder removed afterwards); ``backend``: ``gloo``, ``nccl`` or ``auto``; ``poll``
    is called every 0.05 s while they run (a progress bar reads files); ``nice``: the ranks'
    priority increment (negative: ahead of other work on the machine, where privileged), so that
    timings measure the hardware rather than whatever else shares the cores."""
    with contextlib.ExitStack() as stack:
        folder = log_dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="spawn-")))
        logs = [str(folder / f"rank{r}.log") for r in range(world_size)]
        ctx = mp.get_context("spawn")
        port = _free_port()
        procs = [ctx.Process(target=_rank_main, daemon=True,
                             args=(fn, r, world_size, port, logs[r], args, threads, backend,
                                   collective_timeout_s, nice))
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
                          f"{[r for r, c in enumerate(codes) if c is None]}); raise the timeout"
                break
            if poll is not None:
                poll()
            time.sleep(0.05)
        for proc in procs:
            if proc.exitcode is None:
                proc.kill()  # only the processes this call started
            proc.join(timeout=10)
        if poll is not None:
            poll()
        if failure:
            raise SpawnError(f"{failure}\n{_outputs(logs)}")
        return [Path(log).read_text(errors="replace") for log in logs]
