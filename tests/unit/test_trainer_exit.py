"""A finished rank ends without interpreter finalisation, and its buffered output survives."""

import os
import subprocess
import sys

CODE = ("import sys; from meshmorph.run.trainer import exit_now; "
        "print('out', end=''); print('err', end='', file=sys.stderr); exit_now({code})")


def run(code: int) -> subprocess.CompletedProcess[str]:
    # stdout and stderr are pipes, block-buffered without PYTHONUNBUFFERED: an exit without a
    # flush would lose both
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    return subprocess.run([sys.executable, "-c", CODE.format(code=code)], capture_output=True,
                          text=True, timeout=120, check=False, env=env)


def test_exit_now_keeps_the_output_and_the_code() -> None:
    done = run(3)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out", "err")


def test_exit_now_skips_atexit_handlers() -> None:
    code = ("import atexit; from meshmorph.run.trainer import exit_now; "
            "atexit.register(print, 'finalised'); exit_now(0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0 and "finalised" not in done.stdout
