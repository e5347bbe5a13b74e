"""The run folder's lock: one run at a time, and a finished run leaves no lock file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from meshmorph.run.launch.run_folder import LOCK_FILE, RunFolderError, RunLock


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
