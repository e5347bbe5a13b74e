"""torchrun, with its failures said in one line.

``python -m meshmorph.run.launch.agent <torchrun arguments>`` runs ``torch.distributed.run`` exactly as
``torchrun`` does; when a rank fails it prints which rank, how (exit code or signal) and its pid,
instead of torchrun's own traceback, and exits with 1. A signal that stops the agent itself
(the launcher's escalation) exits quietly with 128 + the signal number.
"""

from __future__ import annotations

import signal
import sys


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

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
    """(rank, failure) that stopped the job: a rank SIGKILLed from outside where one was (the
    ranks it left waiting then fail on their collectives, and torch may see one of them
    first), else the first to fail."""
    first = exc.get_first_failure()
    killed = sorted((failure.timestamp, rank) for rank, failure in exc.failures.items()
                    if failure.exitcode == -signal.SIGKILL
                    and failure.timestamp - first[1].timestamp < AGENT_KILL_AFTER_S)
    if killed:
        rank = killed[0][1]
        return rank, exc.failures[rank]
    return first


if __name__ == "__main__":
    sys.exit(main())
