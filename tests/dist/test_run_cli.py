"""``meshmorph run`` end to end on 2 gloo processes, and Ctrl-C stopping every rank."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from meshmorph.run.checkpoint import scan_checkpoints, verify_checkpoint
from meshmorph.run.launch.launcher import descendants
from tests.helpers.cli import ExampleRun, finish, records, start_cli
from tests.helpers.jobs import TEXT_FILE_JOB, text_file_job


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_text_file_example_trains_on_2_procs_one_metric_line_per_step_and_loss_falls(
        example_run: ExampleRun) -> None:
    # the session's run of examples/jobs/text-file.toml (tests/conftest.py)
    run_dir, output, code = example_run.run_dir, example_run.output, example_run.code
    assert example_run.job == TEXT_FILE_JOB
    assert code == 0, output
    rows = records(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 61)), output
    assert [r["consumed_samples"] for r in rows] == [8 * s for s in range(1, 61)]
    assert sum(line.startswith("step ") for line in output.splitlines()) == 60
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-5:]) / 5
    assert first == pytest.approx(5.55, abs=0.15)  # ln(256): nothing learnt yet
    assert last < first - 1.5, f"loss {first:.3f} -> {last:.3f}"
    assert all(r["tokens_per_s"] > 0 and r["peak_memory_mib"] > 0 and r["lr"] > 0 for r in rows)
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((run_dir / "plan.json").read_text())["dp"] == 2
    complete, ignored = scan_checkpoints(run_dir / "checkpoints")
    assert [p.name for p in complete] == ["step-30", "step-60"] and ignored == []


@pytest.mark.dist
@pytest.mark.timeout(330)
def test_ctrl_c_finishes_the_step_saves_and_prints_the_resume_command(
        tmp_path: Path) -> None:
    job = tmp_path / "long.toml"
    job.write_text(text_file_job(steps=100000, every=3))
    run_dir, log = tmp_path / "run", tmp_path / "out.log"
    proc = start_cli(["run", "--config", str(job), "--nproc", "2", "--out", str(run_dir)], log)
    # the suite's background worlds share the 2 cores: a start-up there took over 120 s once
    deadline = time.monotonic() + 270
    while len(records(run_dir)) < 7 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None and len(records(run_dir)) >= 7, log.read_text()
    started = descendants(proc.pid)
    assert len(started) >= 3  # torchrun and its 2 ranks
    sent = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    code = finish(proc, log, 60)
    stop_s = time.monotonic() - sent
    output = log.read_text()
    assert code == 130, output
    # the step, a checkpoint and the exit of every rank and of torchrun, as the launcher timed
    # them; the suite's background worlds share the cores with this test (10.3, 14.0 and 21.8 s
    # seen under them, the last at a load average of 30, and the launcher's own exit 10 s more
    # at a load average of 17): a hang would run into finish's 60 s
    found = re.search(r"every rank stopped within ([0-9.]+) s", output)
    assert found is not None, output
    ranks_s = float(found.group(1))
    assert ranks_s < 35 and stop_s < 60, f"stopping took {ranks_s:.1f} s ({stop_s:.1f})\n{output}"
    alive = [pid for pid in started if Path(f"/proc/{pid}").exists()]
    assert alive == [], f"processes left behind: {alive}"
    last = records(run_dir)[-1]["step"]
    assert f"stopped by a signal at step {last};" in output, output
    complete, ignored = scan_checkpoints(run_dir / "checkpoints")
    assert ignored == [] and len(complete) == 2  # keep = 2, none half-written
    assert verify_checkpoint(complete[-1]).step == last  # saved where it stopped
    assert verify_checkpoint(complete[0]).step == (last - 1) // 3 * 3  # the one before it
    assert (f"resume with:\n  meshmorph run --config {job} --nproc 2 --plan "
            f"{run_dir / 'plan.json'} --out {run_dir} --resume") in output, output
    assert "Traceback" not in output and not (run_dir / ".meshmorph.stop").exists()
