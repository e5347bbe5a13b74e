"""A rank SIGKILLed mid-step: the three survivors recover on their own and train on to the
numbers of one device.

4 gloo processes train gpt-tiny under ZeRO-3 over 4 (fp32, global batch 8); at every step
boundary each writes its pieces to the node-local store (``/dev/shm``, ``elastic/live/store.py``).
In step 4, during the forward of its second micro-batch, rank 3 kills itself with SIGKILL. The
survivors see the collective fail, form a process group of three, ask the planner for a plan of
three devices with the same global batch, read the state of step 3 from the store (rank 3's
ZeRO-3 shards included: the store outlives its worker) into the new engine, and train the
remaining steps. Checked: every tensor hash after recovery equals the one before the kill; the
per-step losses, gradient norms and final parameters equal one process on the same samples
(the equivalence matrix's tolerances); every sample id is consumed once, the interrupted step's
samples by the survivors only.

The job runs in the background of the test session (``BACKGROUND_JOBS``, tests/conftest.py), its
processes at a lower CPU priority.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.helpers.harness import full_params
from tests.helpers.oracle import OPTIM, SEED, even_plan, gpt_tiny
from tests.helpers.reshape import (
    GLOBAL_BATCH,
    WORLD,
    assert_every_sample_once,
    assert_matches_one_device,
    batches,
    rank_step,
)
from tests.helpers.world import BACKGROUND_NICE, Job

STEPS, KILL_AT, VICTIM = 6, 3, 3
REGROUP_TIMEOUT_S = 120
"""How long the processes wait for each other to form a group (and a collective of it waits)."""


def _kill_in_second_forward(engine) -> None:  # noqa: ANN001
    calls = {"n": 0}

    def hook(module, args) -> None:  # noqa: ANN001
        calls["n"] += 1
        if calls["n"] == 2:  # the second micro-batch's forward: mid-step
            os.kill(os.getpid(), signal.SIGKILL)

    next(iter(engine.model_parts[0].blocks.values())).register_forward_pre_hook(hook)


def kill_job(rank: int, out: Path, run_id: str) -> None:
    import torch.distributed as dist

    from meshmorph.elastic.live.controller import regroup, replan
    from meshmorph.elastic.moves.layout import layout_of
    from meshmorph.elastic.live.local_state import extract_state, state_hashes
    from meshmorph.elastic.moves.move_plan import plan_move
    from meshmorph.elastic.live.restore_state import restore_from_store, restore_step
    from meshmorph.elastic.live.store import NodeStore
    from meshmorph.run.engine.train_engine import build_engine

    gpt, data = gpt_tiny(), batches(STEPS)
    plan = even_plan(gpt, dp=4, zero=3, global_batch=GLOBAL_BATCH, num_microbatches=2)
    store = NodeStore(run_id, 0)
    regroup(out, "g0", rank, list(range(WORLD)), timeout_s=REGROUP_TIMEOUT_S)
    engine = build_engine(gpt, plan, OPTIM, seed=SEED, device=torch.device("cpu"))
    step, consumed, log = 0, 0, (out / f"steps{rank}.jsonl").open("a")
    while step < STEPS:
        try:
            state = extract_state(engine, consumed_samples=consumed)
            store.save(rank, step, plan.to_json(), state)
            if step == KILL_AT:
                before = state_hashes(engine, state.small)
                if dist.get_rank() == 0:
                    (out / "before.json").write_text(json.dumps(before))
                if rank == VICTIM:
                    _kill_in_second_forward(engine)
            loss, norm, ids = rank_step(engine, data[step], consumed)
        except RuntimeError:
            if step != KILL_AT:
                raise
            start = time.perf_counter()
            survivors = [r for r in range(WORLD) if r != VICTIM]
            regroup(out, "g1", rank, survivors, timeout_s=REGROUP_TIMEOUT_S)
            new_plan = replan(gpt, len(survivors), global_batch=GLOBAL_BATCH)
            done = restore_step(store, list(range(WORLD)))
            engine = build_engine(gpt, new_plan, OPTIM, seed=99, device=torch.device("cpu"))
            report = restore_from_store(store, new_rank=dist.get_rank(), old_rank=rank,
                                        step=done, model=gpt, plan_b=new_plan, engine=engine)
            state = extract_state(engine, consumed_samples=consumed)
            after = state_hashes(engine, state.small)
            move = plan_move(layout_of(gpt, plan), layout_of(gpt, new_plan), survivors)
            if dist.get_rank() == 0:
                (out / "after.json").write_text(json.dumps({
                    "hashes": after, "step": done, "plan": new_plan.to_dict(),
                    "bytes_from": report.bytes_from, "time_s": time.perf_counter() - start,
                    "bytes_moved": move.bytes_moved, "from_store": move.checkpoint_bytes,
                    "lower_bound_bytes": move.lower_bound_bytes}))
            plan, step, consumed = new_plan, done, state.small.consumed_samples
            continue
        log.write(json.dumps({"step": step, "loss": loss, "grad_norm": norm, "plan": plan.dp,
                              "dp_rank": engine.dp_rank, "ids": ids,
                              "pp_rank": engine.train_mesh.pp_rank}) + "\n")
        log.flush()
        step, consumed = step + 1, consumed + GLOBAL_BATCH
    torch.save(full_params(engine), out / f"params{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def _main(rank: int, out: str, run_id: str) -> None:
    fd = os.open(os.path.join(out, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.nice(BACKGROUND_NICE)  # in the background of the test session: the foreground tests come first
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        kill_job(rank, Path(out), run_id)
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    os._exit(0)


def run_kill_job(out: Path, timeout_s: float = 400) -> dict[int, int | None]:
    """Start the 4 processes; every one still running at the timeout is killed. Exit codes."""
    from meshmorph.elastic.live.store import NodeStore

    run_id = f"test-kill-{uuid.uuid4().hex[:8]}"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_main, args=(r, str(out), run_id), daemon=True)
             for r in range(WORLD)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and any(p.exitcode is None for p in procs):
            time.sleep(0.1)
    finally:
        for proc in procs:
            if proc.exitcode is None:
                proc.kill()  # only the processes this test started
            proc.join(timeout=10)
        NodeStore(run_id, 0).clear()
    return {r: p.exitcode for r, p in enumerate(procs)}


def background_job(out: Path, worlds: dict[str, Path | None]) -> None:
    """The 4 processes, their exit codes written to ``codes.json``."""
    codes = run_kill_job(out)
    (out / "codes.json").write_text(json.dumps({str(r): c for r, c in codes.items()}))


BACKGROUND_JOBS = [Job("reshape_kill", background_job)]


@pytest.fixture(scope="module")
def kill_results(background: Callable[[str], Path]) -> Path:
    out = background("reshape_kill")
    codes = {int(r): c for r, c in json.loads((out / "codes.json").read_text()).items()}
    logs = "\n".join(f"--- rank {r} ---\n" + (out / f"rank{r}.log").read_text()[-4000:]
                     for r in range(WORLD) if (out / f"rank{r}.log").exists())
    assert codes == {0: 0, 1: 0, 2: 0, 3: -signal.SIGKILL}, f"{codes}\n{logs}"
    return out


def _entries(out: Path) -> list[dict]:
    return [json.loads(line) for r in range(WORLD) if (out / f"steps{r}.jsonl").exists()
            for line in (out / f"steps{r}.jsonl").read_text().splitlines()]


@pytest.mark.dist
@pytest.mark.timeout(60, func_only=True)
def test_survivors_of_a_sigkill_restore_every_tensor_of_the_last_step_boundary(
        kill_results: Path) -> None:
    before = json.loads((kill_results / "before.json").read_text())
    after = json.loads((kill_results / "after.json").read_text())
    assert after["step"] == KILL_AT and after["plan"]["dp"] * after["plan"]["pp"] * \
        after["plan"]["tp"] == WORLD - 1
    assert sorted(k for k in before if before[k] != after["hashes"].get(k)) == []
    assert len(before) > 100
    assert after["from_store"] > 0  # rank 3's ZeRO-3 shards had no live holder


@pytest.mark.dist
@pytest.mark.timeout(60, func_only=True)
def test_survivors_of_a_sigkill_train_to_the_one_device_numbers(kill_results: Path) -> None:
    assert_matches_one_device(_entries(kill_results), kill_results.glob("params*.pt"), STEPS)


@pytest.mark.dist
@pytest.mark.timeout(60, func_only=True)
def test_survivors_of_a_sigkill_consume_every_sample_once(kill_results: Path) -> None:
    assert_every_sample_once(_entries(kill_results), STEPS)
