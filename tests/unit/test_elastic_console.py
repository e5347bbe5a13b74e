"""An ``--elastic`` run's console: a failure the run recovered from reads as one line per event,
torch's output of the restart going to a log in the run folder; a failure it did not recover
from shows everything, as without the relay."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from meshmorph.run.launch.agent import _report_restarts
from meshmorph.run.launch.console import (
    Relay,
    is_noise,
    last_step,
    lost_line,
    parse_event,
    recovered_line,
    restart_event,
)

GLOO = ("meshmorph: error on rank {}: a collective failed: [/pytorch/third_party/gloo/gloo/"
        "transport/tcp/pair.cc:537] Read error [127.0.0.1]:53955: Connection reset by peer. GLHF!; "
        "another rank stopped or died (its message is above); continue from the newest checkpoint "
        "with --resume")
TORCH_E = ("E1128 03:40:44.999000 4576 site-packages/torch/distributed/elastic/multiprocessing/"
           "api.py:1002] failed (exitcode: 1) local_rank: 0 (pid: 4627) of binary: python")
TORCH_W = ("W1128 03:44:53.191000 9281 site-packages/torch/distributed/elastic/multiprocessing/"
           "api.py:1028] Sending process 9329 closing signal SIGTERM")
KILLED = restart_event(3, {0: (1, None), 1: (1, None), 2: (1, None), 3: (-9, "SIGKILL")}, 1, 3)


def _relay(tmp_path: Path, step: int | None = 4) -> tuple[Relay, io.StringIO]:
    console = io.StringIO()
    return Relay(tmp_path, console, lambda: step, hold_s=60.0), console


def test_the_agents_event_line_round_trips() -> None:
    event = parse_event(KILLED)
    assert event is not None and event["rank"] == 3 and event["restart"] == 1
    assert event["failures"]["3"] == [-9, "SIGKILL"]
    assert parse_event("meshmorph: rank 3 lost") is None
    assert parse_event("meshmorph-event {not json") is None


def test_one_line_per_event() -> None:
    event = parse_event(KILLED)
    assert lost_line(event, 4, {0, 1, 2}) == (
        "meshmorph: rank 3 lost at step 4 (SIGKILL); restarting the workers (restart 1 of 3)")
    assert lost_line(event, None, set()).startswith("meshmorph: rank 3 lost (SIGKILL);")
    assert recovered_line(3, 4, 4, ["own"]) == (
        "meshmorph: recovered at step 3 from memory (node-local store), continuing on 4 ranks")
    assert recovered_line(5, 2, 4, ["own", "ring-rank2", "ring-rank3"]) == (
        "meshmorph: recovered at step 5 from memory (node-local store and ring copies), "
        "continuing on 2 ranks (was 4)")
    assert recovered_line(5, 2, 4, ["net-ring-rank2", "own"]) == (
        "meshmorph: recovered at step 5 from memory (node-local store and ring copies, some "
        "pulled from another node), continuing on 2 ranks (was 4)")


def test_a_rank_that_failed_on_its_own_is_named_not_the_peer_whose_collective_failed() -> None:
    # torch saw rank 0 first, but rank 0 only lost its peer; rank 2 raised an error of its own
    event = parse_event(restart_event(0, {0: (1, None), 1: (-15, "SIGTERM"), 2: (1, None)}, 2, 3))
    assert lost_line(event, 7, {0}) == (
        "meshmorph: rank 2 failed at step 7 (exit code 1); restarting the workers "
        "(restart 2 of 3)")
    # every local rank only saw its collective fail: a peer elsewhere (another node) went
    event = parse_event(restart_event(0, {0: (1, None), 1: (1, None)}, 1, 3))
    assert lost_line(event, 4, {0, 1}).startswith(
        "meshmorph: lost a peer at step 4: rank 0's collective failed")


def test_noise_is_torchs_log_the_workers_errors_and_tracebacks() -> None:
    for line in (GLOO.format(2), TORCH_E, TORCH_W, "Traceback (most recent call last):"):
        assert is_noise(line), line
    for line in ("meshmorph: injected failure: SIGKILL rank 3 (pid 1) in step 4",
                 "meshmorph: reshape at step 3: tp 1 x pp 1 x dp 4", "a warning of the user's"):
        assert not is_noise(line), line


def test_a_recovered_restart_shows_its_events_and_keeps_torchs_noise_in_a_log(
        tmp_path: Path) -> None:
    relay, console = _relay(tmp_path)
    relay.feed("a line before the failure", 0.0)
    for rank in (2, 0, 1):
        relay.feed(GLOO.format(rank), 1.0)
    relay.feed(TORCH_W, 1.1)
    relay.feed(TORCH_E, 1.2)
    relay.feed(KILLED, 1.3)
    relay.feed("Traceback (most recent call last):", 1.4)  # a worker stopped for the restart
    relay.feed('  File "worker.py", line 1, in <module>', 1.4)
    relay.feed("KeyboardInterrupt", 1.4)
    relay.feed(recovered_line(3, 4, 4, ["own"]), 5.0)
    relay.feed("meshmorph: reshape at step 3: ...", 5.0)
    relay.close()  # the job ended: nothing is held any more
    log = tmp_path / "logs" / "restart-1.log"
    assert console.getvalue().splitlines() == [
        "a line before the failure",
        "meshmorph: rank 3 lost at step 4 (SIGKILL); restarting the workers (restart 1 of 3)",
        "meshmorph: recovered at step 3 from memory (node-local store), continuing on 4 ranks",
        f"meshmorph: torch's log of the restart: {log}",
        "meshmorph: reshape at step 3: ...",
    ]
    assert log.read_text().splitlines() == [GLOO.format(2), GLOO.format(0), GLOO.format(1),
                                            TORCH_W, TORCH_E, "Traceback (most recent call last):",
                                            '  File "worker.py", line 1, in <module>',
                                            "KeyboardInterrupt"]
    # a second recovered restart gets a log of its own
    relay.feed(TORCH_E, 9.0)
    relay.feed(recovered_line(8, 4, 4), 9.5)
    assert relay.logs == [log, tmp_path / "logs" / "restart-2.log"]


def test_a_failure_that_did_not_recover_shows_everything_in_order(tmp_path: Path) -> None:
    relay, console = _relay(tmp_path)
    relay.feed(GLOO.format(0), 1.0)
    relay.feed(KILLED, 1.1)
    relay.feed("meshmorph: error on rank 3: no step is stored for every rank", 2.0)
    relay.feed("meshmorph: rank 3 (pid 12) exited with code 2; the job stopped", 3.0)
    relay.close()
    assert console.getvalue().splitlines() == [
        "meshmorph: rank 3 lost at step 4 (SIGKILL); restarting the workers (restart 1 of 3)",
        GLOO.format(0),
        "meshmorph: error on rank 3: no step is stored for every rank",
        "meshmorph: rank 3 (pid 12) exited with code 2; the job stopped",
    ]
    assert not (tmp_path / "logs").exists()


def test_held_lines_reach_the_console_when_nothing_recovers_in_time(tmp_path: Path) -> None:
    relay, console = _relay(tmp_path)
    relay.feed(TORCH_W, 10.0)
    relay.tick(69.0)
    assert console.getvalue() == ""
    relay.tick(70.0)
    assert console.getvalue().splitlines() == [TORCH_W]
    relay.feed("a later line", 71.0)  # calm again: straight through
    assert console.getvalue().splitlines() == [TORCH_W, "a later line"]


def test_the_step_comes_from_the_newest_step_line_of_the_metrics(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    assert last_step(metrics) is None
    metrics.write_text("".join(json.dumps(r) + "\n" for r in (
        {"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0}, {"event": "state", "ranks": []})))
    assert last_step(metrics) == 2


def _failure(rank: int, exitcode: int) -> ProcessFailure:
    failure = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode,
                             error_file="/nonexistent")
    failure.timestamp = 100
    return failure


class _Spec:
    max_restarts = 3


class _Group:
    spec = _Spec()


class _Agent:
    def __init__(self, left: int) -> None:
        self._remaining_restarts = left


def test_the_agent_says_which_rank_failed_when_it_restarts_the_group(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    failed = RunResult(state=WorkerState.FAILED,
                       failures={0: _failure(0, 1), 3: _failure(3, -9), 1: _failure(1, -15)})
    monkeypatch.setattr(LocalElasticAgent, "_monitor_workers", lambda self, group: failed)
    _report_restarts()
    monitor = LocalElasticAgent._monitor_workers
    assert monitor(_Agent(3), _Group()) is failed
    (line,) = capsys.readouterr().err.splitlines()
    event = parse_event(line)
    assert event is not None and (event["rank"], event["restart"]) == (3, 1)
    assert event["failures"] == {"0": [1, None], "1": [-15, "SIGTERM"], "3": [-9, "SIGKILL"]}
    monitor(_Agent(0), _Group())  # no restart left: the job's failure is main's to say
    assert capsys.readouterr().err == ""
    healthy = RunResult(state=WorkerState.HEALTHY)
    monkeypatch.setattr(LocalElasticAgent, "_monitor_workers", lambda self, group: healthy)
    _report_restarts()
    LocalElasticAgent._monitor_workers(_Agent(3), _Group())
    assert capsys.readouterr().err == ""
