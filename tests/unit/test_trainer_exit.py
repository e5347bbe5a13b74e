"""A finished rank ends without interpreter finalisation, and its buffered output survives.

One child process serves both tests (starting one imports torch): it registers an atexit
handler that would print, writes to stdout and stderr, and ends with ``exit_now(3)``."""

import os
import subprocess
import sys
from functools import cache

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
