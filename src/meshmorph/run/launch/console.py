"""What an ``--elastic`` run's console says about a failure the run recovered from.

The launcher reads everything torchrun's agent and its workers write to stderr and relays it
(``Relay``). While things go well a line passes straight through. A failure starts with noise:
the surviving workers' failed collectives (gloo's ``pair.cc`` errors), torch's ``W``/``E`` log
lines, tracebacks of workers stopped for the restart. From the first such line on, stderr is
held back. Then:

- the agent restarts the worker group (``agent.py`` writes one ``restart_event`` line, which the
  relay turns into ``rank 3 lost at step 4 (SIGKILL); restarting ...``, the step being the
  one after the newest in metrics.jsonl);
- the restarted workers rebuild the state and say so (``recovered_line``): the held lines go to
  ``RUN/logs/restart-N.log``, and the console gets one line naming it;
- the job ends without recovering (or nothing recovers within ``HOLD_S``): every held line goes
  to the console, in order, as it would have without the relay, so a real failure shows its
  cause and the launcher's ``--resume`` advice as before.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from meshmorph.run.metrics import parse_line

EVENT_PREFIX = "meshmorph-event "
"""Starts a line the agent writes for the launcher alone (JSON after it); never shown."""
RECOVERED = "meshmorph: recovered at step "
"""Starts the line the restarted workers print once the state is rebuilt."""
HOLD_S = 120.0
"""Held lines not followed by a recovery within this many seconds go to the console."""
LOG_FOLDER = "logs"
"""Under the run folder: one ``restart-N.log`` of torch's output per recovered restart."""

_TORCH_LOG = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ ")
"""torch's C++ and Python log lines (``E1128 03:40:44.999000 4576 site-packages/...``)."""
_NOISE = ("Traceback (most recent call last)", "meshmorph: error on rank ", "pair.cc",
          "ProcessGroupGloo", "torch.distributed.elastic")
_COLLECTIVE = re.compile(r"^meshmorph: error on rank (\d+): a collective (?:failed|waited|timed)")


def is_noise(line: str) -> bool:
    """Whether a stderr line belongs to a failure's aftermath (a worker's error, torch's log,
    a traceback): the lines held back until the run recovers or ends."""
    return bool(_TORCH_LOG.match(line)) or any(sign in line for sign in _NOISE)


def restart_event(rank: int, failures: dict[int, tuple[int, str | None]], restart: int,
                  max_restarts: int) -> str:
    """The agent's line for the launcher: the worker group failed, ``rank`` first (the agent's
    pick of the cause), ``failures`` rank -> (exit code, signal name or None) of every rank
    that ended, and it restarts (``restart`` of ``max_restarts``)."""
    return EVENT_PREFIX + json.dumps({
        "event": "restart", "rank": rank, "restart": restart, "max_restarts": max_restarts,
        "failures": {str(r): [code, name] for r, (code, name) in sorted(failures.items())}})


def parse_event(line: str) -> dict[str, Any] | None:
    """The record of an agent's event line; None for any other line."""
    if not line.startswith(EVENT_PREFIX):
        return None
    try:
        record = json.loads(line[len(EVENT_PREFIX):])
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) else None


def _culprit(event: dict[str, Any], collective_ranks: set[int]) -> tuple[int, int, str | None]:
    """(rank, exit code, signal name) of the failure that caused the restart: the agent's pick,
    unless that rank only saw a collective fail and another rank exited with an error of its
    own (ranks torch terminated for the restart, by SIGTERM, are casualties)."""
    failures = {int(r): (int(code), name) for r, (code, name) in event["failures"].items()}
    rank = int(event["rank"])
    code, name = failures.get(rank, (1, None))
    if code >= 0 and rank in collective_ranks:
        own = [r for r, (c, _) in sorted(failures.items()) if c > 0 and r not in collective_ranks]
        if own:
            rank, (code, name) = own[0], failures[own[0]]
    return rank, code, name


def lost_line(event: dict[str, Any], step: int | None, collective_ranks: set[int]) -> str:
    """The console's line for a restart: which rank went and how, at which step (None:
    unknown, e.g. on a node other than rank 0's). ``collective_ranks``: the ranks that said
    their collective failed (a peer went away)."""
    rank, code, name = _culprit(event, collective_ranks)
    at = f" at step {step}" if step is not None else ""
    if code < 0:
        what = f"rank {rank} lost{at} ({name or f'signal {-code}'})"
    elif rank in collective_ranks:  # none of this node's ranks died: a peer elsewhere went
        what = f"lost a peer{at}: rank {rank}'s collective failed (another rank stopped or died)"
    else:
        what = f"rank {rank} failed{at} (exit code {code})"
    return (f"meshmorph: {what}; restarting the workers (restart {event['restart']} of "
            f"{event['max_restarts']})")


def recovered_line(step: int, world: int, old_world: int, sources: list[str] | None = None
                   ) -> str:
    """What the restarted workers print once every rank holds the state of ``step`` again;
    ``sources``: the names the pieces came from (``own``, ``ring-rank3``, ``net-node-rank2``...)."""
    names = sources or []
    where = "node-local store" + (" and ring copies" if any("ring" in n for n in names) else "")
    if any(n.startswith("net-") for n in names):
        where += ", some pulled from another node"
    was = f" (was {old_world})" if old_world != world else ""
    return f"{RECOVERED}{step} from memory ({where}), continuing on {world} ranks{was}"


def last_step_record(metrics: Path) -> dict[str, Any] | None:
    """The newest step line of a metrics.jsonl (None: no file or no step line)."""
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        record = parse_line(line)
        if record is not None and "step" in record and "event" not in record:
            return record
    return None


def last_step(metrics: Path) -> int | None:
    """The newest step of a metrics.jsonl (None: no file or no step line)."""
    record = last_step_record(metrics)
    return None if record is None else int(record["step"])


class Relay:
    """stderr of torchrun's agent and workers, line by line, to the console or a restart's log.

    ``step_now``: the step the job is in (None: unknown). ``feed`` takes each line (without its
    newline) with the time it came; ``tick`` lets held lines out after ``hold_s`` without a
    recovery; ``close`` lets out whatever is held (the job ended without recovering)."""

    def __init__(self, out_dir: Path, console: TextIO, step_now: Callable[[], int | None], *,
                 hold_s: float = HOLD_S) -> None:
        self.out_dir = out_dir
        self.console = console
        self.step_now = step_now
        self.hold_s = hold_s
        self.held: list[str] = []
        self.held_since: float | None = None
        self.logs: list[Path] = []
        """The restart logs written, in order."""
        self._lock = threading.Lock()  # the reading thread feeds, the launcher closes

    def _say(self, line: str) -> None:
        self.console.write(line + "\n")
        self.console.flush()

    def feed(self, line: str, now: float) -> None:
        with self._lock:
            self._feed(line, now)

    def _feed(self, line: str, now: float) -> None:
        event = parse_event(line)
        if event is not None:
            if self.held_since is None:
                self.held_since = now
            collective = {int(m.group(1)) for m in map(_COLLECTIVE.match, self.held) if m}
            self._say(lost_line(event, self.step_now(), collective))
            return
        if line.startswith(RECOVERED):
            self._say(line)
            if self.held:
                self._say(f"meshmorph: torch's log of the restart: {self._write_log()}")
            self.held, self.held_since = [], None
            return
        if self.held_since is None and not is_noise(line):
            self._say(line)
            return
        if self.held_since is None:
            self.held_since = now
        self.held.append(line)

    def _write_log(self) -> Path:
        folder = self.out_dir / LOG_FOLDER
        folder.mkdir(parents=True, exist_ok=True)
        number = 1
        while (folder / f"restart-{number}.log").exists():
            number += 1
        path = folder / f"restart-{number}.log"
        path.write_text("".join(line + "\n" for line in self.held))
        self.logs.append(path)
        return path

    def tick(self, now: float) -> None:
        with self._lock:
            if self.held_since is not None and now - self.held_since >= self.hold_s:
                self._release()

    def close(self) -> None:
        """Every held line to the console, in order (the job ended without recovering)."""
        with self._lock:
            self._release()

    def _release(self) -> None:
        for line in self.held:
            self.console.write(line + "\n")
        self.console.flush()
        self.held, self.held_since = [], None
