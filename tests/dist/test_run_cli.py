"""``meshmorph run`` end to end on 2 gloo processes, and Ctrl-C stopping every rank."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshmorph.run.checkpoint import scan_checkpoints, verify_checkpoint
from meshmorph.run.launch.launcher import descendants

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "jobs"


def start_cli(args: list[str], log: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "meshmorph.cli.app", *args], text=True,
                            stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def finish(proc: subprocess.Popen[str], log: Path, timeout_s: float) -> int:
    """Wait for the launcher; past the timeout kill everything it started and fail with the
    output of every rank."""
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        for pid in [*descendants(proc.pid), proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"meshmorph ran past {timeout_s} s; output:\n{log.read_text()}")


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [row for row in rows if "event" not in row]  # step lines only


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_text_file_example_trains_on_2_procs_one_metric_line_per_step_and_loss_falls(
        tmp_path: Path) -> None:
    run_dir, log = tmp_path / "run", tmp_path / "out.log"
    proc = start_cli(["run", "--config", str(EXAMPLES / "text-file.toml"), "--nproc", "2",
                      "--out", str(run_dir)], log)
    code = finish(proc, log, 150)
    output = log.read_text()
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
@pytest.mark.timeout(180)
def test_ctrl_c_finishes_the_step_saves_and_prints_the_resume_command(
        tmp_path: Path) -> None:
    job = tmp_path / "long.toml"
    job.write_text((EXAMPLES / "text-file.toml").read_text()
                   .replace("steps = 60", "steps = 100000").replace("every = 30", "every = 3")
                   .replace('"../data/tiny.txt"', f'"{(EXAMPLES.parent / "data" / "tiny.txt")}"'))
    run_dir, log = tmp_path / "run", tmp_path / "out.log"
    proc = start_cli(["run", "--config", str(job), "--nproc", "2", "--out", str(run_dir)], log)
    deadline = time.monotonic() + 120
    while len(records(run_dir)) < 7 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None and len(records(run_dir)) >= 7, log.read_text()
    started = descendants(proc.pid)
    assert len(started) >= 3  # torchrun and its 2 ranks
    sent = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    code = finish(proc, log, 30)
    stop_s = time.monotonic() - sent
    output = log.read_text()
    assert code == 130, output
    assert stop_s < 10, f"stopping took {stop_s:.1f} s\n{output}"
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
