"""A finished rank ends without interpreter finalisation, and its buffered output survives; a
rank asked to resume where no checkpoint lies refuses.

One child process serves the first two tests (starting one imports torch): it registers an
atexit handler that would print, writes to stdout and stderr, and ends with ``exit_now(3)``."""

import os
import socket
import subprocess
import sys
from functools import cache
from pathlib import Path

from tests.helpers.jobs import gpt_tiny_job, write_job

CODE = ("import atexit, sys; from meshmorph.run.trainer import exit_now; "
        "atexit.register(print, 'finalised'); "
        "print('out', end=''); print('err', end='', file=sys.stderr); exit_now(3)")


@cache
def run() -> subprocess.CompletedProcess[str]:
    # stdout and stderr are pipes, block-buffered without PYTHONUNBUFFERED: an exit without a
    # flush would lose both
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    return subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True,
                          timeout=120, check=False, env=env)


def test_exit_now_keeps_the_output_and_the_code() -> None:
    done = run()
    assert (done.returncode, done.stdout, done.stderr) == (3, "out", "err")


def test_exit_now_skips_atexit_handlers() -> None:
    done = run()
    assert done.returncode == 3 and "finalised" not in done.stdout


def test_the_rank_program_refuses_resume_where_no_checkpoint_lies(tmp_path: Path) -> None:
    # what meshmorph run refuses before launch, the rank program (run by hand across nodes)
    # refuses too, rather than starting from step 0
    from meshmorph.run.job import load_job
    from meshmorph.run.launch.launcher import default_plan
    from meshmorph.spec.catalog import load_model

    job = write_job(tmp_path, gpt_tiny_job(checkpoint={"every": 2}))
    loaded = load_job(job)
    plan = tmp_path / "plan.json"
    plan.write_text(default_plan(loaded, load_model("gpt-tiny", 32), 1).to_json())
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port))
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "meshmorph.run.trainer", "--job", str(job),
                           "--plan", str(plan), "--out", str(run_dir), "--resume"],
                          capture_output=True, text=True, timeout=120, check=False, env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert (f"meshmorph: error on rank 0: --resume: no checkpoint in {run_dir / 'checkpoints'} "
            "to continue from; check --out, or run without --resume to start from step 0"
            in done.stderr), done.stderr
    assert "Traceback" not in done.stderr and not (run_dir / "metrics.jsonl").exists()
