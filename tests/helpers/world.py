"""Many checks in one spawned world: every multi-process test module that only needs a gloo
process group of N ranks declares its work as ``Part``s, and one spawned job of N processes runs
the parts of every selected module in turn (``run_parts``), instead of one job per module.

Starting a rank costs seconds (importing torch and meshmorph's runtime), N of them on two cores
several times that; a world pays it once. Each part writes what its tests read into a folder of
its own; a part that raises on a rank leaves ``error<rank>.txt`` there (read by
``part_folder``, which fails the part's tests with every rank's traceback) and the world goes on
with the next part after a barrier. A part that replaces the default process group (the
reshapes regroup their processes) says so (``regroups``), and the world forms a fresh group of
all ranks, rank r on process r, before the next part.
"""

from __future__ import annotations

import gc
import json
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

PartFn = Callable[[int, int, Path], None]
"""``fn(rank, world_size, out)``: a module-level function run on every rank of the world."""


@dataclass(frozen=True, slots=True)
class Part:
    """One piece of work of a spawned world."""

    name: str
    """Its folder under the world's result folder (unique over the suite)."""
    fn: PartFn
    """Run on every rank as ``fn(rank, world_size, folder)``."""
    world: int
    """Number of processes it needs."""
    timeout_s: float
    """Its share of the world's timeout: the job is killed past the sum over its parts."""
    regroups: bool = False
    """Whether it replaces the default process group (the world re-forms it afterwards)."""


def collect() -> None:
    """Free the garbage of the work just done, then leave what survives it out of later
    collections (``gc.freeze``): a full collection of a rank that has imported torch walks
    hundreds of thousands of live objects (0.2-0.4 s each time, a tenth of the equivalence
    matrix's CPU), while after a freeze it walks only what was made since."""
    gc.collect()
    gc.freeze()


def run_parts(rank: int, world_size: int, result_dir: str, parts: Iterable[Part]) -> None:
    """Spawned on every rank: each part in turn, one barrier after each."""
    import torch.distributed as dist

    collect()  # the imports' objects, once
    for part in parts:
        out = Path(result_dir) / part.name
        out.mkdir(parents=True, exist_ok=True)
        start, cpu = time.perf_counter(), time.process_time()
        try:
            part.fn(rank, world_size, out)
        except Exception:
            (out / f"error{rank}.txt").write_text(traceback.format_exc())
            print(f"rank {rank} part {part.name} failed:\n{traceback.format_exc()}", flush=True)
        if part.regroups:
            from meshmorph.elastic.live.controller import regroup

            regroup(Path(result_dir), f"after-{part.name}", rank, list(range(world_size)),
                    timeout_s=180)
        collect()
        dist.barrier()
        took = {"wall_s": time.perf_counter() - start, "cpu_s": time.process_time() - cpu}
        (out / f"seconds{rank}.json").write_text(json.dumps(took))
        print(f"rank {rank} part {part.name}: {took}", flush=True)


def part_folder(result_dir: Path, name: str) -> Path:
    """The folder of part ``name``, after checking that no rank failed in it."""
    out = result_dir / name
    errors = sorted(out.glob("error*.txt"))
    assert not errors, f"part {name} failed:\n" + "\n".join(
        f"--- {e.name} ---\n{e.read_text()}" for e in errors)
    assert out.is_dir(), f"part {name} did not run"
    return out


JobFn = Callable[[Path, "dict[str, Path | None]"], None]
"""``fn(folder, worlds)``: runs in the test process's background thread; ``worlds`` maps each
world fixture to its result folder (None where it was not run or failed)."""


@dataclass(frozen=True, slots=True)
class Job:
    """Work a module's tests read that needs no test to watch it, run in the background of the
    session (tests/conftest.py): a job of its own processes, a command-line run to its end, or
    one that follows up on a world's results; the tests read its folder through the
    ``background`` fixture. ``fn`` keeps its own timeouts (its processes are killed past them)
    and starts its processes at a lower priority (``BACKGROUND_NICE``)."""

    name: str
    """Its folder's name (unique over the suite)."""
    fn: JobFn
    """Writes what the tests read into the folder it is given."""
    after_worlds: bool = False
    """Whether it reads the worlds' results (it then runs once they are done)."""


BACKGROUND_NICE = 10
"""CPU priority increment of everything started in the background: the foreground tests (and
the times some of them measure) come first."""
