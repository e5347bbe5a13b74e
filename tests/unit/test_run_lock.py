"""The run folder's lock: one run at a time, and a finished run leaves no lock file; the nodes
of one multi-node run share the folder, node 0 owning its records."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from meshmorph.run.job import load_job
from meshmorph.run.launch.run_folder import LOCK_FILE, RunFolderError, RunLock
from meshmorph.spec.plan import Plan
from tests.helpers.jobs import gpt_tiny_job, write_job

PLAN = Plan(model="gpt-tiny", seq_len=32, global_batch=8, dp=2, micro_batch=2,
            num_microbatches=2, dtype="fp32")


def test_the_lock_keeps_a_second_run_out_and_is_gone_after_the_run(tmp_path: Path) -> None:
    lock = tmp_path / LOCK_FILE
    with RunLock(tmp_path):
        assert lock.read_text() == f"{os.getpid()}\n"
        with pytest.raises(RunFolderError, match=f"in use by another meshmorph run \\(pid "
                                                 f"{os.getpid()}"):
            RunLock(tmp_path).acquire()
    assert not lock.exists()
    with RunLock(tmp_path):  # the folder takes the next run
        assert lock.exists()
    assert not lock.exists()


def test_the_nodes_of_one_run_share_the_folder_each_under_its_own_lock(tmp_path: Path) -> None:
    with RunLock(tmp_path), RunLock(tmp_path, 1):  # node 0 (or a plain run) and node 1
        assert (tmp_path / LOCK_FILE).exists() and (tmp_path / ".meshmorph.node-1.lock").exists()
        for node in (None, 0, 1):  # but each only once
            with pytest.raises(RunFolderError, match="in use by another meshmorph run"):
                RunLock(tmp_path, node).acquire()
    assert not list(tmp_path.glob(".meshmorph*"))


def test_node_1_joins_the_folder_node_0_runs_in_without_touching_its_records(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from meshmorph.run.launch import launcher

    job_path = write_job(tmp_path, gpt_tiny_job(checkpoint={"every": 2}))
    out = tmp_path / "run"
    (out / "checkpoints" / "step-2").mkdir(parents=True)  # node 0 already saved
    (out / "plan.json").write_text("node 0's\n")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    given: dict[str, object] = {}

    def start(run: object, plan_path: Path, rendezvous: list[str], lock_fd: int
              ) -> subprocess.Popen[bytes]:
        given.update(path=plan_path, plan=Plan.load(plan_path))
        return subprocess.Popen(["true"], stderr=subprocess.PIPE)  # torchrun, done at once

    monkeypatch.setattr(launcher, "_start", start)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    run = launcher.PreparedRun(job_path=job_path, job=load_job(job_path), model=None,  # type: ignore[arg-type]
                               plan=PLAN, nproc=1, out_dir=out, resume=False, elastic="1:2",
                               node=launcher.ElasticNode(1, "localhost:29500", "job-7"))
    with RunLock(out):  # node 0's launcher holds the folder
        assert launcher.launch(run, quiet=True) == 0
    assert given == {"path": out / ".meshmorph.node-1.plan.json", "plan": PLAN}
    assert (out / "plan.json").read_text() == "node 0's\n" and (out / "metrics.jsonl").exists()
    assert not list(out.glob(".meshmorph*")) and not list(out.glob("earlier-*"))
