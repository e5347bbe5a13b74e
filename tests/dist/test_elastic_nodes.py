"""Two nodes under torchrun's elastic agent, simulated on one machine, and one of them lost.

Each node is its own ``meshmorph run --elastic 1:2 --nproc 2 --node-rank K --rdzv-endpoint
localhost:PORT`` (its own torchrun agent, the same c10d rendezvous, node 0 hosting its store),
with its node store under a root of its own (``MESHMORPH_STORE_ROOT``), so neither node can read
the other's memory. They train a ZeRO-3 plan over 4 ranks; node 1's agent and its workers are
then SIGKILLed and its memory removed. The surviving agent re-rendezvouses at world size 2, the
workers re-plan for 2 devices and rebuild the state from their own store and the ring copy of
the lost node's ranks, and training ends with the numbers of one process trained on the same
sample sequence, no sample skipped or repeated.

It takes about 1.5-3 minutes on 2 loaded cores (the survivor waits out the rendezvous's 30 s
last call for the lost node), so it runs as a background job of the session
(``BACKGROUND_JOBS``, tests/conftest.py) at a lower priority, and the test reads what it left.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from meshmorph.run.launch.launcher import descendants
from meshmorph.run.trainer import SAMPLE_LOG_ENV
from tests.helpers.cli import ENVIRONMENT, finish, records, start_cli
from tests.helpers.jobs import ELASTIC_GLOBAL_BATCH as GLOBAL_BATCH
from tests.helpers.jobs import ELASTIC_STEPS as STEPS
from tests.helpers.jobs import elastic_job
from tests.helpers.world import BACKGROUND_NICE, Job


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start_node(k: int, tmp_path: Path, job: Path, plan: Path, endpoint: str, run_id: str
                ) -> subprocess.Popen[str]:
    env = dict(ENVIRONMENT, MESHMORPH_STORE_ROOT=str(tmp_path / f"memory-node{k}"))
    env[SAMPLE_LOG_ENV] = str(tmp_path / "ids")
    return start_cli(["run", "--config", str(job), "--nproc", "2", "--plan", str(plan), "--out",
                      str(tmp_path / f"node{k}"), "--elastic", "1:2", "--node-rank", str(k),
                      "--rdzv-endpoint", endpoint, "--rdzv-id", run_id],
                     tmp_path / f"node{k}.log", env=env, nice=BACKGROUND_NICE)


def _kill_node(proc: subprocess.Popen[str]) -> None:
    """SIGKILL a node's launcher, its torchrun agent and its workers at once."""
    tree = descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in [proc.pid, *tree]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def _rows(tmp_path: Path) -> dict[int, dict]:
    """Step -> metrics line, whichever node's rank 0 logged it (the survivor's last)."""
    rows: dict[int, dict] = {}
    for k in (1, 0):
        rows.update({row["step"]: row for row in records(tmp_path / f"node{k}")})
    return rows


def _ids_by_step(folder: Path) -> dict[int, list[int]]:
    """Step -> the sample ids trained in it, from its newest restart round (a round that died
    rolls its unfinished steps back)."""
    entries = [json.loads(line) for path in sorted(folder.glob("samples-rank*.jsonl"))
               for line in path.read_text().splitlines()]
    newest = {e["step"]: max(f["round"] for f in entries if f["step"] == e["step"])
              for e in entries}
    by_step: dict[int, list[int]] = {}
    for e in sorted(entries, key=lambda e: (e["step"], e["dp_rank"])):
        if e["round"] == newest[e["step"]]:
            by_step.setdefault(e["step"], []).extend(e["ids"])
    return by_step


def run_job(tmp_path: Path, worlds: dict[str, Path | None]) -> None:
    """The one-process yardstick, then the two nodes; node 1 is killed after two steps and
    node 0 runs to its end. What the test needs besides the folders goes to ``job.json``."""
    job, plan = elastic_job(tmp_path)
    # the yardstick: one process, the same job and sample sequence
    (tmp_path / "ref-ids").mkdir()
    ref_log = tmp_path / "ref.log"
    env = dict(ENVIRONMENT, **{SAMPLE_LOG_ENV: str(tmp_path / "ref-ids")})
    ref = start_cli(["run", "--config", str(job), "--nproc", "1", "--out", str(tmp_path / "ref")],
                    ref_log, env=env, nice=BACKGROUND_NICE)
    assert finish(ref, ref_log, 600) == 0, ref_log.read_text()

    (tmp_path / "ids").mkdir()
    endpoint, run_id = f"localhost:{_free_port()}", f"nodes-{uuid.uuid4().hex[:8]}"
    node0 = _start_node(0, tmp_path, job, plan, endpoint, run_id)
    node1 = _start_node(1, tmp_path, job, plan, endpoint, run_id)
    try:
        deadline = time.monotonic() + 480
        while max(_rows(tmp_path), default=0) < 2:  # two steps on 4 ranks, then node 1 dies
            assert node0.poll() is None and node1.poll() is None, \
                (tmp_path / "node0.log").read_text() + (tmp_path / "node1.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "node0.log").read_text()
            time.sleep(0.2)
    finally:
        _kill_node(node1)
    killed_after = max(_rows(tmp_path))
    shutil.rmtree(tmp_path / "memory-node1", ignore_errors=True)  # its memory went with it
    code = finish(node0, tmp_path / "node0.log", 600)
    (tmp_path / "job.json").write_text(json.dumps({"killed_after": killed_after, "code": code}))


BACKGROUND_JOBS = [Job("elastic_nodes", run_job)]


@pytest.fixture(scope="module")
def nodes_folder(background: Callable[[str], Path]) -> Path:
    """The job's folder, waited for here (not inside the test's timeout)."""
    return background("elastic_nodes")


@pytest.mark.dist
@pytest.mark.timeout(60, func_only=True)
def test_a_lost_node_shrinks_the_job_to_the_survivors_and_it_trains_like_one_process(
        nodes_folder: Path) -> None:
    tmp_path = nodes_folder
    facts = json.loads((tmp_path / "job.json").read_text())
    killed_after, code = facts["killed_after"], facts["code"]
    reference = records(tmp_path / "ref")
    output = (tmp_path / "node0.log").read_text()
    assert code == 0, output

    events = [json.loads(line) for line in (tmp_path / "node0" / "metrics.jsonl")
              .read_text().splitlines() if '"event"' in line]
    (reshape,) = [e for e in events if e.get("event") == "reshape"]
    assert reshape["from"]["dp"] * reshape["from"]["tp"] * reshape["from"]["pp"] == 4
    to = reshape["to"]
    assert to["dp"] * to["tp"] * to["pp"] == 2 and to["global_batch"] == GLOBAL_BATCH, output
    assert 1 <= reshape["at_step"] <= killed_after
    assert reshape["consumed_samples"] == reshape["at_step"] * GLOBAL_BATCH
    lost = reshape["lost"]
    assert len(lost) == 2 and sorted(lost + reshape["survivors"]) == [0, 1, 2, 3]
    # the lost node's ZeRO-3 shards came from the survivor's ring copy, the rest from its store
    sources = reshape["sources_all_ranks"]
    assert {f"ring-rank{r}" for r in lost} <= set(sources) <= \
        {"own", *(f"node-rank{r}" for r in reshape["survivors"]),
         *(f"ring-rank{r}" for r in lost)}, sources
    assert f"meshmorph: reshape at step {reshape['at_step']}" in output
    assert "(zero 3, 4 ranks) -> " in output and "2 ranks)" in output

    rows = _rows(tmp_path)
    assert sorted(rows) == list(range(1, STEPS + 1)), output
    assert [rows[s]["consumed_samples"] for s in sorted(rows)] == \
        [GLOBAL_BATCH * s for s in range(1, STEPS + 1)]
    for want, s in zip(reference, sorted(rows), strict=True):
        got = rows[s]
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-6), (s, got, want)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4, abs=1e-6), s

    ids, ref_ids = _ids_by_step(tmp_path / "ids"), _ids_by_step(tmp_path / "ref-ids")
    assert sorted(ids) == list(range(1, STEPS + 1))
    flat = [i for s in sorted(ids) for i in ids[s]]
    assert len(flat) == len(set(flat)) == STEPS * GLOBAL_BATCH  # no gap, no sample twice
    assert {s: sorted(v) for s, v in ids.items()} == {s: sorted(v) for s, v in ref_ids.items()}
