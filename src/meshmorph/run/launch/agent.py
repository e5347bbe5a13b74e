"""torchrun, with its failures said in one line.

``python -m meshmorph.run.launch.agent <torchrun arguments>`` runs ``torch.distributed.run`` exactly as
``torchrun`` does; when a rank fails it prints which rank, how (exit code or signal) and its pid,
instead of torchrun's own traceback, and exits with 1. A signal that stops the agent itself
(the launcher's escalation) exits quietly with 128 + the signal number. When the worker group
fails and the agent restarts it (``--max-restarts``), one ``restart_event`` line on stderr tells
the launcher which rank failed and how (run/launch/console.py turns it into the console's line).
"""

from __future__ import annotations

import signal
import sys


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    _report_restarts()
    try:
        run(parse_args(argv))
    except ChildFailedError as exc:
        rank, failure = _cause(exc)
        how = (f"was killed by {failure.signal_name()}" if failure.exitcode < 0
               else f"exited with code {failure.exitcode}")
        others = sorted(set(exc.failures) - {rank})
        print(f"meshmorph: rank {rank} (pid {failure.pid}) {how}; the job stopped"
              + (f" (ranks {', '.join(map(str, others))} failed after it)" if others else ""),
              file=sys.stderr, flush=True)
        return 1
    except SignalException as exc:
        return 128 + int(exc.sigval)
    return 0


AGENT_KILL_AFTER_S = 10
"""A rank SIGKILLed this long or more after the first failure was killed by the agent stopping
the job (torch's agent sends SIGTERM, then SIGKILL after a 30 s grace): a casualty, not the
cause."""


def _cause(exc):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202
    """(rank, failure) that stopped the job (``cause_of`` its failures)."""
    return cause_of(exc.failures)


def cause_of(failures):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN201
    """(rank, failure) of rank -> ProcessFailure that caused the others: a rank SIGKILLed from
    outside where one was (the ranks it left waiting then fail on their collectives, and torch
    may see one of them first), else the first to fail."""
    first = min(failures.items(), key=lambda item: item[1].timestamp)
    killed = sorted((failure.timestamp, rank) for rank, failure in failures.items()
                    if failure.exitcode == -signal.SIGKILL
                    and failure.timestamp - first[1].timestamp < AGENT_KILL_AFTER_S)
    if killed:
        rank = killed[0][1]
        return rank, failures[rank]
    return first


def _report_restarts() -> None:
    """Make torch's local agent write a ``restart_event`` line whenever its worker group failed
    and it is about to restart it (a restart left); the job's last failure is ``main``'s."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from meshmorph.run.launch.console import restart_event

    monitor = LocalElasticAgent._monitor_workers

    def reporting(self, group):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202
        result = monitor(self, group)
        left = getattr(self, "_remaining_restarts", 0)
        if result.state in {WorkerState.FAILED, WorkerState.UNHEALTHY} and result.failures \
                and left > 0:
            rank, _ = cause_of(result.failures)
            failures = {r: (f.exitcode, f.signal_name() if f.exitcode < 0 else None)
                        for r, f in result.failures.items()}
            most = group.spec.max_restarts
            print(restart_event(rank, failures, most - left + 1, most), file=sys.stderr,
                  flush=True)
        return result

    LocalElasticAgent._monitor_workers = reporting  # type: ignore[method-assign]


if __name__ == "__main__":
    sys.exit(main())
