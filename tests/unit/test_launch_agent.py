"""The launcher's one-line failure names the rank that stopped the job."""

from __future__ import annotations

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from meshmorph.run.launch.agent import _cause


def _failure(rank: int, exitcode: int, timestamp: int) -> ProcessFailure:
    failure = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode,
                             error_file="/nonexistent")
    failure.timestamp = timestamp
    return failure


def test_a_rank_killed_by_a_signal_is_named_though_its_peer_was_seen_failing_first() -> None:
    # rank 1 was SIGKILLed; rank 0 then failed on its collective, and torch saw rank 0 first
    exc = ChildFailedError("train", {0: _failure(0, 1, 100), 1: _failure(1, -9, 101)})
    assert exc.get_first_failure()[0] == 0
    assert _cause(exc)[0] == 1


def test_a_rank_the_agent_killed_while_stopping_the_job_is_not_named() -> None:
    # rank 1 froze; rank 0's collective timed out and it failed; the agent's SIGTERM did not
    # stop rank 1, its SIGKILL did 30 s later
    exc = ChildFailedError("train", {0: _failure(0, 1, 100), 1: _failure(1, -9, 130)})
    assert _cause(exc)[0] == 0


def test_without_a_signal_the_first_rank_to_fail_is_named() -> None:
    exc = ChildFailedError("train", {0: _failure(0, 1, 300), 1: _failure(1, 2, 200)})
    assert _cause(exc)[0] == 1
