"""How a rank learns that it should stop at the next step boundary.

Three ways, all turned into one flag that the ranks agree on before every step: SIGINT/SIGTERM
(from torchrun, or a user signalling a rank), the launcher's stop file in the run folder (its
Ctrl-C: a file, so a request made while the ranks still import torch is not lost), and the death
of the rank's parent (torchrun) or of the launcher, which a watchdog thread notices within a
second. A rank whose parent died and that has not stopped ``ORPHAN_DEADLINE_S`` later exits.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType

LAUNCHER_PID_ENV = "MESHMORPH_LAUNCHER_PID"
"""Environment variable holding the pid of the ``meshmorph run`` process that started torchrun."""
WATCH_INTERVAL_S = 1.0
"""How often the watchdog looks at the parent and the launcher."""
ORPHAN_DEADLINE_S = 300.0
"""Seconds an orphaned rank gets to stop at a step boundary (and save) before it exits anyway."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class StopFlag:
    """Turns signals, the stop file and a dead parent into a request to stop at the next step
    boundary; ``agreed`` makes every rank stop at the same one."""

    def __init__(self, *, install_signals: bool = True) -> None:
        self.requested = False
        """Whether this rank was asked to stop."""
        self.reason = ""
        """What asked it (``SIGINT``, ``stop file``, ``torchrun died``, ...)."""
        self.stop_path: Path | None = None
        """The run folder's stop file, once known."""
        if install_signals:
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.request(signal.Signals(signum).name)

    def request(self, reason: str) -> None:
        if not self.requested:
            self.requested, self.reason = True, reason

    def local(self) -> bool:
        """Whether this rank alone was asked to stop (signal, stop file or dead parent)."""
        if not self.requested and self.stop_path is not None and self.stop_path.exists():
            self.request("the launcher's stop request")
        return self.requested

    def agreed(self) -> bool:
        """Whether any rank was asked to stop (collective: every rank must call it)."""
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            return self.local()
        flag = torch.tensor([int(self.local())], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # a CPU tensor: gloo on every backend
        return bool(flag.item())

    def watch_parents(self, *, interval_s: float = WATCH_INTERVAL_S,
                      deadline_s: float = ORPHAN_DEADLINE_S) -> threading.Thread:
        """Start a daemon thread that requests a stop when torchrun (this process's parent) or
        the launcher dies, and ends the process if it has not stopped ``deadline_s`` later."""
        parent = os.getppid()
        launcher = int(os.environ.get(LAUNCHER_PID_ENV, "0") or 0)

        def watch() -> None:
            while True:
                time.sleep(interval_s)
                if os.getppid() != parent:
                    reason = f"its parent (torchrun, pid {parent}) died"
                elif launcher and not _alive(launcher):
                    reason = f"the launcher (pid {launcher}) died"
                else:
                    continue
                rank = os.environ.get("RANK", "?")
                print(f"meshmorph: rank {rank} stops: {reason}", file=sys.stderr, flush=True)
                self.request(reason)
                time.sleep(deadline_s)
                print(f"meshmorph: rank {rank} did not stop within {deadline_s:.0f} s of {reason}; "
                      "exiting", file=sys.stderr, flush=True)
                os._exit(3)

        thread = threading.Thread(target=watch, name="meshmorph-parent-watch", daemon=True)
        thread.start()
        return thread
