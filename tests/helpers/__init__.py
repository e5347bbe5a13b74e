"""What the test modules share: the spawn harness (``spawn``, ``world``), the one-device oracle
and its tolerance rule (``reference``, ``oracle``), the command-line launcher helpers (``cli``)
and the job files (``jobs``). ``tests/conftest.py`` turns them into fixtures."""
