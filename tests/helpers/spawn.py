"""Run a function on N real gloo processes on CPU, with a hard timeout: meshmorph's own
``meshmorph.profile.spawn`` pinned to gloo, one thread per rank.

``spawn(fn, world_size, args, timeout_s)`` starts N spawned processes, each with its stdout and
stderr written to its own log file, one process group created once per job. On the first rank
that fails, or at the timeout, every rank still running is killed and ``SpawnError`` carries
every rank's output.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from meshmorph.profile.spawn import SpawnError
from meshmorph.profile.spawn import spawn as _spawn

__all__ = ["SpawnError", "spawn"]


def spawn(fn: Callable[..., Any], world_size: int, args: tuple[Any, ...] = (), *,
          timeout_s: float = 300.0, collective_timeout_s: float = 120.0,
          nice: int = 0) -> list[str]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; returns each rank's
    output. ``fn`` must be importable (a module-level function); ``nice``: the ranks' CPU
    priority increment (19: only what other work leaves)."""
    return _spawn(fn, world_size, args, timeout_s=timeout_s, backend="gloo",
                  collective_timeout_s=collective_timeout_s, nice=nice)
