"""Fixtures and hooks shared by the test suite.

The spawned worlds (``helpers/world.py``): ``world4`` and ``world2`` are the result folders of
one gloo job of 4 (2) processes that ran the ``WORLD_PARTS`` of every selected test module using
the fixture; only the parts of modules whose tests were selected run. The jobs start as soon as
collection ends, in the background at a lower CPU priority (``nice`` 10), and the tests run in
three groups: the single-process tests first (the worlds compute on the core they leave), then
the other multi-process tests (the worlds take what they leave idle: launchers waiting for
ranks, rendezvous, sleeps), then the tests that read a world, waiting for it where it is not
done. Each job keeps a timeout (the sum of its parts' shares); the fixture waits for its job and
fails every test using it with every rank's output if the job failed.

``background``: the ``BACKGROUND_JOBS`` of the selected modules that use this fixture:
multi-process work no test needs to watch (a job whose rank kills itself, a command-line run to
its end, restores that follow up on a world's results), taken in collection order by
``JOB_THREADS`` background threads (and by the worlds' thread once the worlds and the jobs that
read them are done: those run in it, after the worlds), at the same lower priority; most of a
job's time is its processes starting, meeting and waiting, so two run side by side;
``background(name)`` waits for a job and gives its folder. While anything runs in the
background the test process computes with one thread.

``example_run``: the committed example job (examples/jobs/text-file.toml) trained by ``meshmorph
run --nproc 2`` once per session (a background job), with a free ``MASTER_PORT`` given; the
tests of the example, of the rendezvous port and of resuming and resharding a data-parallel
checkpoint read it (those that change its run folder change a copy).
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.helpers.cli import ENVIRONMENT, ExampleRun, kill_left_over
from tests.helpers.jobs import TEXT_FILE_JOB
from tests.helpers.world import BACKGROUND_NICE, Job, Part

WORLDS = {"world4": 4, "world2": 2}
"""The world fixtures and their number of processes (started in this order)."""
JOB_THREADS = 2
"""Background threads that take the jobs which read no world, one job at a time each."""
WORLD_COLLECTIVE_TIMEOUT_S = 300.0
"""How long a collective of a world may wait for a peer (a failed part's peers give up then);
a rank of lower priority may wait for a core while a foreground test holds both."""
BACKGROUND = "background"
"""The fixture through which tests read the background jobs (``BACKGROUND_JOBS``)."""


def _uses(item: pytest.Item, fixture: str) -> bool:
    return fixture in getattr(item, "fixturenames", ())


def _selected_parts(items: list[pytest.Item], fixture: str, size: int) -> list[Part]:
    """The parts of size ``size`` of every module with a selected test using ``fixture``, in
    collection order, each once."""
    parts: dict[str, Part] = {}
    for item in items:
        if not _uses(item, fixture):
            continue
        for part in getattr(getattr(item, "module", None), "WORLD_PARTS", ()):
            if part.world == size:
                assert parts.setdefault(part.name, part) == part, f"two parts named {part.name}"
    return list(parts.values())


def _selected_jobs(items: list[pytest.Item]) -> list[Job]:
    """The background jobs of every module with a selected test using ``background``, and the
    example run where a selected test uses ``example_run``."""
    jobs: dict[str, Job] = {}
    if any(_uses(item, "example_run") for item in items):
        jobs[EXAMPLE_JOB.name] = EXAMPLE_JOB
    for item in items:
        if _uses(item, BACKGROUND):
            for job in getattr(getattr(item, "module", None), "BACKGROUND_JOBS", ()):
                assert jobs.setdefault(job.name, job) == job, f"two jobs named {job.name}"
    return list(jobs.values())


class Background:
    """This session's background work in threads of the test process: the worlds, then the
    jobs that read them, then whatever other jobs are left; and ``JOB_THREADS`` threads taking
    the other jobs in order. ``result(name)`` waits for a world or a job and gives its folder (or
    raises its error)."""

    def __init__(self, worlds: list[tuple[str, int, list[Part], Path]],
                 jobs: list[tuple[Job, Path]]) -> None:
        self.worlds, self.jobs = worlds, jobs
        names = [name for name, _, _, _ in worlds] + [job.name for job, _ in jobs]
        self.done = {name: threading.Event() for name in names}
        self.folders = {name: out for name, _, _, out in worlds}
        self.folders.update({job.name: out for job, out in jobs})
        self.failed: dict[str, BaseException] = {}
        self.waiting = [(job, out) for job, out in jobs if not job.after_worlds]
        """The jobs that read no world, not yet taken by a thread (in collection order)."""
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run_worlds, name="worlds", daemon=True)]
        self.threads += [threading.Thread(target=self._run_jobs, name=f"jobs{i}", daemon=True)
                         for i in range(JOB_THREADS)]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def _run_worlds(self) -> None:
        from tests.helpers.spawn import spawn
        from tests.helpers.world import run_parts

        for name, size, parts, out in self.worlds:
            self._do(name, lambda size=size, parts=parts, out=out: spawn(
                run_parts, size, (str(out), parts), timeout_s=sum(p.timeout_s for p in parts),
                collective_timeout_s=WORLD_COLLECTIVE_TIMEOUT_S, nice=BACKGROUND_NICE))
        ready = {name: None if name in self.failed else out
                 for name, _, _, out in self.worlds}
        for job, out in self.jobs:
            if job.after_worlds:
                self._do(job.name, lambda job=job, out=out: job.fn(out, ready))
        self._run_jobs()

    def _run_jobs(self) -> None:
        """The waiting jobs, one at a time, until none is left."""
        while True:
            with self.lock:
                if not self.waiting:
                    return
                job, out = self.waiting.pop(0)
            self._do(job.name, lambda job=job, out=out: job.fn(out, {}))

    def _do(self, name: str, work: Callable[[], object]) -> None:
        try:
            work()
        except BaseException as error:  # reported by the fixture, in the test's thread
            self.failed[name] = error
        finally:
            kill_left_over()  # a run the job left running, as after a foreground test
            self.done[name].set()

    def result(self, name: str) -> Path:
        """The folder of world or job ``name`` once it is done."""
        assert name in self.done, f"{name} was not started: no selected test reads it"
        self.done[name].wait()
        if name in self.failed:
            raise self.failed[name]
        return self.folders[name]


_background: Background | None = None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The single-process tests first (the worlds compute meanwhile), then the other
    multi-process tests, then the tests reading a world; the order within each group is kept."""
    def group(item: pytest.Item) -> int:
        if any(_uses(item, fixture) for fixture in (*WORLDS, BACKGROUND, "example_run")):
            return 2
        return 1 if item.get_closest_marker("dist") else 0

    items.sort(key=group)


@pytest.fixture(autouse=True)
def _no_run_left_over() -> Iterator[None]:
    """After each test, every ``meshmorph`` command it started and left running is killed, so a
    failed test cannot leave a run computing beside the tests after it."""
    yield
    kill_left_over()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the worlds and background jobs the selected tests read."""
    global _background
    if session.config.option.collectonly:
        return
    factory = session.config._tmp_path_factory  # type: ignore[attr-defined]
    worlds = []
    for fixture, size in WORLDS.items():
        parts = _selected_parts(session.items, fixture, size)
        if parts:
            worlds.append((fixture, size, parts, factory.mktemp(fixture)))
    jobs = [(job, factory.mktemp(job.name)) for job in _selected_jobs(session.items)]
    if worlds or jobs:
        import torch

        # the background takes the other core: one thread here, not two spinning OpenMP
        # threads that slow every kernel down many times over on a core another process holds
        torch.set_num_threads(1)
        _background = Background(worlds, jobs)
        _background.start()


def _result(name: str) -> Path:
    assert _background is not None, f"{name} was not started: no selected test reads it"
    return _background.result(name)


@pytest.fixture(scope="session")
def world4() -> Path:
    """The result folder of the 4-process world (one subfolder per part)."""
    return _result("world4")


@pytest.fixture(scope="session")
def world2() -> Path:
    """The result folder of the 2-process world (one subfolder per part)."""
    return _result("world2")


@pytest.fixture(scope="session")
def background() -> Callable[[str], Path]:
    """``background(name)``: the folder of background job ``name`` once it is done."""
    return _result


def run_example(folder: Path, worlds: dict[str, Path | None]) -> None:
    """In the background: the example job to its end, a free ``MASTER_PORT`` given, the torchrun
    agent's command line read while it runs; what the fixture needs goes to ``example.json``."""
    from meshmorph.run.launch.launcher import descendants
    from tests.helpers.cli import command_line, finish, start_cli, wait_for

    run_dir, log = folder / "run", folder / "out.log"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = start_cli(["run", "--config", str(TEXT_FILE_JOB), "--nproc", "2", "--out",
                      str(run_dir)], log, env={**ENVIRONMENT, "MASTER_PORT": str(port)},
                     nice=BACKGROUND_NICE)

    def agents() -> list[str]:
        return [cmd for cmd in map(command_line, descendants(proc.pid))
                if "meshmorph.run.launch.agent" in cmd]

    wait_for(lambda: bool(agents()), proc, log, 300)
    agent = agents()[0]
    code = finish(proc, log, 600)
    (folder / "example.json").write_text(json.dumps({"code": code, "port": port,
                                                     "agent_command": agent}))


EXAMPLE_JOB = Job("example_run", run_example)
"""The background job behind ``example_run`` (started where a selected test uses it)."""


@pytest.fixture(scope="session")
def example_run() -> ExampleRun:
    """The example job trained once for the session (see the module docstring)."""
    folder = _result(EXAMPLE_JOB.name)
    facts = json.loads((folder / "example.json").read_text())
    return ExampleRun(TEXT_FILE_JOB, folder / "run", (folder / "out.log").read_text(),
                      facts["code"], facts["port"], facts["agent_command"])
