"""Run a function on N local processes over gloo (CPU) or NCCL (one GPU each), hard timeout.

Each rank's stdout and stderr go to its own log file; on the first rank that fails, or at the
timeout, every rank still running is killed and ``SpawnError`` carries every rank's output.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
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
               args: tuple[Any, ...], threads: int) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      OMP_NUM_THREADS=str(threads))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=300))
        fn(rank, world_size, *args)
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        os._exit(1)  # do not wait on peers that may be stuck in a collective
    os._exit(0)


def spawn(fn: Callable[..., Any], world_size: int, args: tuple[Any, ...], log_dir: Path, *,
          timeout_s: float, threads: int = 1,
          poll: Callable[[], None] | None = None) -> None:
    """Run ``fn(rank, world_size, *args)`` (a module-level function) on ``world_size``
    processes; ``poll`` is called every 0.1 s while they run (a progress bar reads files)."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    logs = [str(log_dir / f"rank{r}.log") for r in range(world_size)]
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(fn, r, world_size, port, logs[r], args, threads))
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
            failure = f"timed out after {timeout_s:.0f} s; raise the timeout or profile less"
            break
        if poll is not None:
            poll()
        time.sleep(0.1)
    for proc in procs:
        if proc.exitcode is None:
            proc.kill()  # only the processes this call started
        proc.join(timeout=10)
    if poll is not None:
        poll()
    if failure:
        text = "\n".join(f"----- rank {r} -----\n{Path(log).read_text(errors='replace')[-8000:]}"
                         for r, log in enumerate(logs) if os.path.exists(log))
        raise SpawnError(f"{failure}\n{text}")
