"""The ring copy on one machine: ``MESHMORPH_LOCAL_NODE_SIZE=2`` makes 4 local ranks two nodes
of two. Each rank keeps its state in its node's store at every step boundary and, every K steps
(K from the overhead budget, agreed by all ranks), sends it to the same local rank of the next
node. Then node 1 is lost whole (its ranks stop and its store is gone) and the two ranks of node
0 restore the job for 2 devices: the lost node's pieces come from node 0's ring copy, every
tensor's hash equals the one before the loss, and the report names the ring copy as their source.
"""

from __future__ import annotations

import json
import os
import shutil
import traceback
import uuid
from pathlib import Path

import pytest
import torch
from test_equivalence import OPTIM, SEED, _gpt, _plan

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
        gpt = _gpt()
        plan = _plan(gpt, dp=4, zero=3, global_batch=GLOBAL_BATCH, num_microbatches=2)
        engine = build_engine(gpt, plan, OPTIM, seed=SEED, device=torch.device("cpu"))
        tokens = torch.randint(0, gpt.vocab_size, (STEPS, GLOBAL_BATCH, gpt.seq_len + 1),
                               generator=torch.Generator().manual_seed(3))
        share = GLOBAL_BATCH // engine.dp_size
        for step in range(1, STEPS + 1):
            engine.step(tokens[step - 1, engine.dp_rank * share:(engine.dp_rank + 1) * share])
            session.after_step(engine, plan, step, step * GLOBAL_BATCH)
        small = extract_state(engine, consumed_samples=STEPS * GLOBAL_BATCH, checksums=False).small
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
        restored = session.restore(_gpt(), OPTIM, seed=SEED, device=torch.device("cpu"),
                                   total_steps=STEPS + 4)
        assert restored is not None, "the node store held nothing"
        engine, plan, step, consumed, record = restored
        small = extract_state(engine, consumed_samples=consumed, checksums=False).small
        hashes = state_hashes(engine, small)
        sources: list = [None] * dist.get_world_size()
        dist.all_gather_object(sources, record["sources"])
        if dist.get_rank() == 0:
            (out / "after.json").write_text(json.dumps(
                {"hashes": hashes, "step": step, "world": plan.world_size, "sources": sources}))
    except Exception:
        (out / f"error-survive{rank}.txt").write_text(traceback.format_exc())
        raise


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_lost_node_is_restored_from_its_ring_copy(tmp_path: Path) -> None:
    from spawn import spawn

    from meshmorph.elastic.live.store import NodeStore

    torch.set_num_threads(1)
    run_id = f"ring-test-{uuid.uuid4().hex[:8]}"
    node0, node1 = NodeStore(run_id, 0), NodeStore(run_id, 1)
    try:
        spawn(train, 4, (str(tmp_path), run_id), timeout_s=200, collective_timeout_s=60)
        before = json.loads((tmp_path / "before.json").read_text())
        assert before["ring_every"] >= 1 and before["ring_copies"] >= 1
        assert sorted(node0.steps(node0.replicas)) == [2, 3]  # node 1's ranks, kept on node 0
        assert sorted(node1.steps(node1.replicas)) == [0, 1]
        shutil.rmtree(node1.dir)  # node 1 is gone, its memory with it
        spawn(survive, 2, (str(tmp_path), run_id), timeout_s=200, collective_timeout_s=60)
    finally:
        errors = sorted(tmp_path.glob("error*.txt"))
        node0.clear()
    assert not errors, "\n".join(e.read_text() for e in errors)
    after = json.loads((tmp_path / "after.json").read_text())
    assert after["world"] == 2 and after["step"] == STEPS
    changed = sorted(k for k in before["hashes"] if after["hashes"].get(k) != before["hashes"][k])
    assert changed == [], f"{len(changed)} tensors changed: {changed[:5]}"
    names = {name for rank_sources in after["sources"] for name in rank_sources}
    assert {"ring-rank2", "ring-rank3"} <= names and not any("node-rank2" in n for n in names)


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


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_node_that_lost_its_memory_pulls_its_ring_copy_over_the_network(
        tmp_path: Path) -> None:
    """Node 1 restarts with an empty store (its memory is gone) and the job goes on at 4 ranks:
    its workers get old ranks 2 and 3 from the ring copy on node 0 by point-to-point transfer,
    not from node 0's memory (each node's store lives under its own root)."""
    from spawn import spawn

    torch.set_num_threads(1)
    run_id = f"pull-test-{uuid.uuid4().hex[:8]}"
    spawn(train_apart, 4, (str(tmp_path), run_id), timeout_s=200, collective_timeout_s=60)
    before = json.loads((tmp_path / "before.json").read_text())
    memory1 = tmp_path / "memory-node1"
    assert memory1.is_dir() and str(tmp_path / "memory-node0") in before["store"]
    shutil.rmtree(memory1)  # node 1 restarts with nothing in memory
    spawn(rejoin, 4, (str(tmp_path), run_id), timeout_s=200, collective_timeout_s=60)
    errors = sorted(tmp_path.glob("error*.txt"))
    assert not errors, "\n".join(e.read_text() for e in errors)
    after = json.loads((tmp_path / "after.json").read_text())
    assert after["world"] == 4 and after["step"] == STEPS
    changed = sorted(k for k in before["hashes"] if after["hashes"].get(k) != before["hashes"][k])
    assert changed == [], f"{len(changed)} tensors changed: {changed[:5]}"
    assert after["sources"][0] == after["sources"][1] == {"own": after["sources"][0]["own"]}
    assert set(after["sources"][2]) == {"net-ring-rank2"}
    assert set(after["sources"][3]) == {"net-ring-rank3"}
    # the store was written again under the plan that runs now: node 1 holds its ranks once more
    from meshmorph.elastic.live.store import NodeStore

    node1 = NodeStore(run_id, 1, root=memory1)
    assert node1.steps() == {2: [STEPS], 3: [STEPS]}
