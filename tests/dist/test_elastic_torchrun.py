"""``meshmorph run --elastic`` under torchrun's elastic agent: a rank SIGKILLed mid-step, the
worker group restarted by torchrun, the state rebuilt from the node-local store, and the run
ending exactly where an uninterrupted run of the same plan ends; the console says so in one line
per event, torch's output of the restart kept in a log under the run folder.

Both runs (the uninterrupted one and the one with the failure) are a background job of the
session (``BACKGROUND_JOBS``, tests/conftest.py); the test reads their folders."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from meshmorph.run.trainer import SAMPLE_LOG_ENV
from tests.helpers.cli import ENVIRONMENT, finish, records, start_cli
from tests.helpers.jobs import ELASTIC_GLOBAL_BATCH as GLOBAL_BATCH
from tests.helpers.jobs import ELASTIC_STEPS as STEPS
from tests.helpers.jobs import elastic_job
from tests.helpers.world import BACKGROUND_NICE, Job


def run_elastic(tmp_path: Path, name: str, job: Path, plan: Path, *extra: str
                ) -> tuple[Path, str]:
    """``meshmorph run --elastic 1:1`` of the plan on 4 processes, to its end: (run folder,
    output); fails unless it exits 0."""
    run_dir, log, samples = tmp_path / name, tmp_path / f"{name}.log", tmp_path / f"{name}-ids"
    samples.mkdir()
    proc = start_cli(["run", "--config", str(job), "--nproc", "4", "--plan", str(plan),
                      "--out", str(run_dir), "--elastic", "1:1", *extra], log,
                     env={**ENVIRONMENT, SAMPLE_LOG_ENV: str(samples)}, nice=BACKGROUND_NICE)
    code = finish(proc, log, 600)
    output = log.read_text()
    assert code == 0, output
    return run_dir, output


def run_job(folder: Path, worlds: dict[str, Path | None]) -> None:
    """The uninterrupted run, then the one whose rank 3 is killed in step 3."""
    job, plan = elastic_job(folder)
    run_elastic(folder, "ref", job, plan)
    run_elastic(folder, "killed", job, plan, "--inject-failure", "3@3")


BACKGROUND_JOBS = [Job("elastic_torchrun", run_job)]


@pytest.fixture(scope="module")
def torchrun_folder(background: Callable[[str], Path]) -> Path:
    """The job's folder, waited for here (not inside the test's timeout)."""
    return background("elastic_torchrun")


def trained_ids(folder: Path) -> dict[tuple[int, int], list[int]]:
    """(step, dp rank) -> sample ids, the newest restart round's entry winning (a round that
    died rolls its unfinished steps back)."""
    newest: dict[tuple[int, int], tuple[int, list[int]]] = {}
    for path in sorted(folder.glob("samples-rank*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            key = (row["step"], row["dp_rank"])
            if key not in newest or row["round"] >= newest[key][0]:
                newest[key] = (row["round"], row["ids"])
    return {key: ids for key, (_, ids) in newest.items()}


@pytest.mark.dist
@pytest.mark.timeout(60, func_only=True)
def test_rank_killed_at_step_3_restarts_under_torchrun_and_ends_with_the_uninterrupted_loss(
        torchrun_folder: Path) -> None:
    tmp_path = torchrun_folder
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "killed"
    output = (tmp_path / "killed.log").read_text()

    assert "injected failure: SIGKILL rank 3" in output, output
    ref, rows = records(ref_dir), records(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), output
    assert [r["consumed_samples"] for r in rows] == [GLOBAL_BATCH * s for s in range(1, 7)]
    # the same plan after the restart: the state came back bit for bit, so every loss is equal
    assert [r["loss"] for r in rows] == [r["loss"] for r in ref], output
    assert [r["grad_norm"] for r in rows] == [r["grad_norm"] for r in ref]

    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    reshapes = [line for line in lines if line.get("event") == "reshape"]
    assert len(reshapes) == 1, output
    (reshape,) = reshapes
    assert reshape["at_step"] == 2  # killed inside step 3: step 2 is the newest every rank stored
    assert reshape["consumed_samples"] == 2 * GLOBAL_BATCH
    assert reshape["from"] == reshape["to"] and reshape["to"]["zero"] == 3
    assert reshape["bytes_moved"] == 0 == reshape["lower_bound_bytes"]  # each rank kept its pieces
    assert 0 < reshape["measured_time_s"] < 120
    assert list(reshape["sources"]) == ["own"]
    assert "meshmorph: reshape at step 2:" in output

    # the console: one line per event, none of torch's output of the restart
    # the step is the one after the newest in metrics.jsonl: rank 0 may not have logged step 2
    # yet when rank 3 dies in step 3
    assert re.search(r"^meshmorph: rank 3 lost at step [23] \(SIGKILL\); restarting the workers "
                     r"\(restart 1 of 3\)$", output, re.M), output
    assert ("meshmorph: recovered at step 2 from memory (node-local store), continuing on 4 "
            "ranks\n") in output, output
    log = run_dir / "logs" / "restart-1.log"
    assert f"meshmorph: torch's log of the restart: {log}\n" in output, output
    for noise in ("pair.cc", "--resume", "Traceback", "a collective failed", "meshmorph-event"):
        assert noise not in output, output
    assert not re.search(r"^[IWEF]\d{4} ", output, re.M), output  # torch's log lines
    kept = log.read_text()
    assert "a collective failed" in kept and re.search(r"^E\d{4} .*failed \(exitcode", kept, re.M)
    assert not any(line.get("event") == "reshape" for line in
                   map(json.loads, (ref_dir / "metrics.jsonl").read_text().splitlines()))

    ids = trained_ids(tmp_path / "killed-ids")
    assert sorted(ids) == [(s, r) for s in range(1, STEPS + 1) for r in range(4)]
    flat = [i for key in sorted(ids) for i in ids[key]]
    assert len(flat) == len(set(flat)) == STEPS * GLOBAL_BATCH  # no sample twice
    assert trained_ids(tmp_path / "ref-ids") == ids  # the same samples at the same steps
