"""The ring copy on one machine: ``MESHMORPH_LOCAL_NODE_SIZE=2`` makes 4 local ranks two nodes
of two. Each rank keeps its state in its node's store at every step boundary and, every K steps
(K from the overhead budget, agreed by all ranks), sends it to the same local rank of the next
node. Then node 1 is lost whole (its ranks stop and its store is gone) and the two ranks of node
0 restore the job for 2 devices: the lost node's pieces come from node 0's ring copy, every
tensor's hash equals the one before the loss, and the report names the ring copy as their source.

Both scenarios train in one part of the 4-process ``world4`` job (one node store shared by the
two simulated nodes, then one store root per node); a background job of the session
(``BACKGROUND_JOBS``, tests/conftest.py) then takes the node's memory away and spawns the
processes that restore; the tests read what both wrote.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.helpers.oracle import OPTIM, SEED, even_plan, gpt_tiny
from tests.helpers.spawn import spawn
from tests.helpers.world import BACKGROUND_NICE, Job, Part, part_folder

GLOBAL_BATCH = 8
STEPS = 2


def train(rank: int, world_size: int, out_dir: str, run_id: str) -> None:
    import torch.distributed as dist

    from meshmorph.elastic.live.elastic_run import ElasticSession
    from meshmorph.elastic.live.local_state import extract_state, state_hashes
    from meshmorph.run.engine.train_engine import build_engine

    out = Path(out_dir)
    try:
        os.environ["MESHMORPH_LOCAL_NODE_SIZE"] = "2"
        session = ElasticSession(run_id, out)
        gpt = gpt_tiny()
        plan = even_plan(gpt, dp=4, zero=3, global_batch=GLOBAL_BATCH, num_microbatches=2)
        engine = build_engine(gpt, plan, OPTIM, seed=SEED, device=torch.device("cpu"))
        tokens = torch.randint(0, gpt.vocab_size, (STEPS, GLOBAL_BATCH, gpt.seq_len + 1),
                               generator=torch.Generator().manual_seed(3))
        share = GLOBAL_BATCH // engine.dp_size
        for step in range(1, STEPS + 1):
            engine.step(tokens[step - 1, engine.dp_rank * share:(engine.dp_rank + 1) * share])
            session.after_step(engine, plan, step, step * GLOBAL_BATCH)
        small = extract_state(engine, consumed_samples=STEPS * GLOBAL_BATCH).small
        hashes = state_hashes(engine, small)
        if dist.get_rank() == 0:
            (out / "before.json").write_text(json.dumps(
                {"hashes": hashes, "ring_every": session.ring_every,
                 "ring_copies": session.ring_copies, "node": session.store.node,
                 "store": str(session.store.run_dir)}))
    except Exception:
        (out / f"error-train{rank}.txt").write_text(traceback.format_exc())
        raise


def survive(rank: int, world_size: int, out_dir: str, run_id: str) -> None:
    import torch.distributed as dist

    from meshmorph.elastic.live.elastic_run import ElasticSession
    from meshmorph.elastic.live.local_state import extract_state, state_hashes

    out = Path(out_dir)
    try:
        os.environ["MESHMORPH_LOCAL_NODE_SIZE"] = "2"
        session = ElasticSession(run_id, out)
        restored = session.restore(gpt_tiny(), OPTIM, seed=SEED, device=torch.device("cpu"),
                                   total_steps=STEPS + 4)
        assert restored is not None, "the node store held nothing"
        engine, plan, step, consumed, record = restored
        small = extract_state(engine, consumed_samples=consumed).small
        hashes = state_hashes(engine, small)
        sources: list = [None] * dist.get_world_size()
        dist.all_gather_object(sources, record["sources"])
        if dist.get_rank() == 0:
            (out / "after.json").write_text(json.dumps(
                {"hashes": hashes, "step": step, "world": plan.world_size, "sources": sources}))
    except Exception:
        (out / f"error-survive{rank}.txt").write_text(traceback.format_exc())
        raise


def _node_memory(out_dir: str, rank: int) -> None:
    """Each simulated node keeps its store under its own root: no node can read another's."""
    os.environ["MESHMORPH_LOCAL_NODE_SIZE"] = "2"
    os.environ["MESHMORPH_STORE_ROOT"] = str(Path(out_dir) / f"memory-node{rank // 2}")


def train_apart(rank: int, world_size: int, out_dir: str, run_id: str) -> None:
    _node_memory(out_dir, rank)
    train(rank, world_size, out_dir, run_id)


def rejoin(rank: int, world_size: int, out_dir: str, run_id: str) -> None:
    _node_memory(out_dir, rank)
    survive(rank, world_size, out_dir, run_id)


def run_id_of(folder: Path) -> str:
    """The store's run id of one scenario (the same on every rank and in the test)."""
    return f"ring-test-{hashlib.sha1(str(folder).encode()).hexdigest()[:8]}"


def _restore(saved: dict[str, str | None]) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def ring_part(rank: int, world_size: int, out: Path) -> None:
    """Both scenarios' training: one store root (``shared``), then one per node (``apart``);
    the environment is left as it was for the world's later parts."""
    import torch.distributed as dist

    saved = {k: os.environ.get(k) for k in ("MESHMORPH_LOCAL_NODE_SIZE", "MESHMORPH_STORE_ROOT")}
    try:
        for name, fn in (("shared", train), ("apart", train_apart)):
            folder = out / name
            folder.mkdir(exist_ok=True)
            fn(rank, world_size, str(folder), run_id_of(folder))
            _restore(saved)
            dist.barrier()
    finally:
        _restore(saved)


WORLD_PARTS = [Part("elastic_ring", ring_part, world=4, timeout_s=120)]


def _record(folder: Path, name: str, what: dict) -> None:
    (folder / f"{name}.json").write_text(json.dumps(what))


def restore_shared(ring: Path) -> None:
    """Scenario 1: node 1 is lost whole (its store removed), node 0's two ranks restore."""
    from meshmorph.elastic.live.store import NodeStore

    folder = ring / "shared"
    run_id = run_id_of(folder)
    node0, node1 = NodeStore(run_id, 0), NodeStore(run_id, 1)
    try:
        # what node 0 and node 1 kept of the other one, read before node 1 goes
        _record(folder, "stores", {"node0_replicas": sorted(node0.steps(node0.replicas)),
                                   "node1_replicas": sorted(node1.steps(node1.replicas))})
        shutil.rmtree(node1.dir)  # node 1 is gone, its memory with it
        spawn(survive, 2, (str(folder), run_id), timeout_s=300, collective_timeout_s=120,
              nice=BACKGROUND_NICE)
    finally:
        node0.clear()
        node1.clear()


def restore_apart(ring: Path) -> None:
    """Scenario 2: node 1 restarts with an empty store (its memory root removed)."""
    folder = ring / "apart"
    memory1 = folder / "memory-node1"
    _record(folder, "stores", {"memory1_was_there": memory1.is_dir()})
    shutil.rmtree(memory1)  # node 1 restarts with nothing in memory
    spawn(rejoin, 4, (str(folder), run_id_of(folder)), timeout_s=300, collective_timeout_s=120,
          nice=BACKGROUND_NICE)


def restore_job(out: Path, worlds: dict[str, Path | None]) -> None:
    """Both restores, after the world trained; each scenario's failure is kept in its folder
    (``error-restore.txt``) for its test, and the other still runs."""
    world = worlds.get("world4")
    assert world is not None, "the world that trains the ring did not run"
    ring = world / "elastic_ring"
    for restore, name in ((restore_shared, "shared"), (restore_apart, "apart")):
        try:
            restore(ring)
        except Exception:
            (ring / name / "error-restore.txt").write_text(traceback.format_exc())
    (out / "ring").write_text(str(ring))


BACKGROUND_JOBS = [Job("elastic_ring_restore", restore_job, after_worlds=True)]


@pytest.fixture(scope="module")
def ring(world4: Path, background: Callable[[str], Path]) -> Path:
    """The part's folder, once the restores are done."""
    part_folder(world4, "elastic_ring")
    return Path((background("elastic_ring_restore") / "ring").read_text())


def _errors(folder: Path) -> str:
    return "\n".join(e.read_text() for e in sorted(folder.glob("error*.txt")))


@pytest.mark.dist
@pytest.mark.timeout(60, func_only=True)
def test_a_lost_node_is_restored_from_its_ring_copy(ring: Path) -> None:
    tmp_path = ring / "shared"
    assert not _errors(tmp_path), _errors(tmp_path)
    before = json.loads((tmp_path / "before.json").read_text())
    assert before["ring_every"] >= 1 and before["ring_copies"] >= 1
    stores = json.loads((tmp_path / "stores.json").read_text())
    assert stores["node0_replicas"] == [2, 3]  # node 1's ranks, kept on node 0
    assert stores["node1_replicas"] == [0, 1]
    after = json.loads((tmp_path / "after.json").read_text())
    assert after["world"] == 2 and after["step"] == STEPS
    changed = sorted(k for k in before["hashes"] if after["hashes"].get(k) != before["hashes"][k])
    assert changed == [], f"{len(changed)} tensors changed: {changed[:5]}"
    names = {name for rank_sources in after["sources"] for name in rank_sources}
    assert {"ring-rank2", "ring-rank3"} <= names and not any("node-rank2" in n for n in names)


@pytest.mark.dist
@pytest.mark.timeout(60, func_only=True)
def test_a_node_that_lost_its_memory_pulls_its_ring_copy_over_the_network(ring: Path) -> None:
    """Node 1 restarts with an empty store (its memory is gone) and the job goes on at 4 ranks:
    its workers get old ranks 2 and 3 from the ring copy on node 0 by point-to-point transfer,
    not from node 0's memory (each node's store lives under its own root)."""
    from meshmorph.elastic.live.store import NodeStore

    tmp_path = ring / "apart"
    assert not _errors(tmp_path), _errors(tmp_path)
    before = json.loads((tmp_path / "before.json").read_text())
    stores = json.loads((tmp_path / "stores.json").read_text())
    assert stores["memory1_was_there"] and str(tmp_path / "memory-node0") in before["store"]
    after = json.loads((tmp_path / "after.json").read_text())
    assert after["world"] == 4 and after["step"] == STEPS
    changed = sorted(k for k in before["hashes"] if after["hashes"].get(k) != before["hashes"][k])
    assert changed == [], f"{len(changed)} tensors changed: {changed[:5]}"
    assert after["sources"][0] == after["sources"][1] == {"own": after["sources"][0]["own"]}
    assert set(after["sources"][2]) == {"net-ring-rank2"}
    assert set(after["sources"][3]) == {"net-ring-rank3"}
    # the store was written again under the plan that runs now: node 1 holds its ranks once more
    node1 = NodeStore(run_id_of(tmp_path), 1, root=tmp_path / "memory-node1")
    assert node1.steps() == {2: [STEPS], 3: [STEPS]}
