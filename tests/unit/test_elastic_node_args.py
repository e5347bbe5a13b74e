"""``meshmorph run --elastic MIN:MAX --node-rank K --rdzv-endpoint HOST:PORT``: what one node of a
multi-node run passes torchrun, and the combinations refused before anything starts."""

from __future__ import annotations

import pytest

from meshmorph.run.launch.launcher import ElasticNode, parse_node
from meshmorph.spec.plan import Plan

PLAN4 = Plan(model="gpt-tiny", seq_len=32, global_batch=8, dp=4, micro_batch=2,
             num_microbatches=1, dtype="fp32")


def test_a_node_of_two_is_checked_against_the_full_world() -> None:
    node = parse_node(1, "node0:29500", None, "1:2", 2, PLAN4)
    assert node == ElasticNode(1, "node0:29500", None)
    assert node.resolved_id() == "meshmorph-node0-29500"  # the same on every node
    assert parse_node(None, None, None, "1:2", 4, PLAN4) is None  # one node, as before


def test_one_machine_cannot_wait_for_more_nodes_than_itself() -> None:
    with pytest.raises(ValueError, match=r"--elastic 3:4 waits for at least 3 nodes, but without "
                                         r"--node-rank and --rdzv-endpoint only this machine"):
        parse_node(None, None, None, "3:4", 2, PLAN4)
    assert parse_node(None, None, None, "1:4", 2, PLAN4) is None  # starts with what is here


@pytest.mark.parametrize(("args", "says"), [
    ((0, "node0:29500", None, None, 2), "--elastic MIN:MAX"),
    ((0, None, None, "1:2", 2), "--rdzv-endpoint go together"),
    ((None, "node0:29500", None, "1:2", 2), "--node-rank and --rdzv-endpoint"),
    ((0, "node0", None, "1:2", 2), "HOST:PORT"),
    ((0, "node0:99999", None, "1:2", 2), "HOST:PORT"),
    ((2, "node0:29500", None, "1:2", 2), "must be 0 to 1"),
    ((-1, "node0:29500", None, "1:2", 2), "must be 0 to 1"),
    ((0, "node0:29500", None, "1:2", 1), "2 nodes x --nproc 1 make 2"),
])
def test_a_node_that_cannot_join_is_refused_naming_the_fix(args: tuple, says: str) -> None:
    node_rank, endpoint, run_id, elastic, nproc = args
    with pytest.raises(ValueError, match=says.replace("-", r"\-")):
        parse_node(node_rank, endpoint, run_id, elastic, nproc, PLAN4)


def test_node_0_hosts_the_rendezvous_and_every_node_shares_its_id() -> None:
    from pathlib import Path

    from meshmorph.run.launch.launcher import PreparedRun, elastic_args

    def args_of(k: int) -> list[str]:
        run = PreparedRun(job_path=Path("job.toml"), job=None, model=None, plan=PLAN4,  # type: ignore[arg-type]
                          nproc=2, out_dir=Path("out"), resume=False, elastic="1:2",
                          node=ElasticNode(k, "node0:29500", "job-7"))
        rendezvous, trainer = elastic_args(run)
        assert trainer == ["--elastic-run-id", "job-7"]
        return rendezvous

    first, second = args_of(0), args_of(1)
    assert first[first.index("--rdzv-conf") + 1] == "is_host=true"
    assert second[second.index("--rdzv-conf") + 1] == "is_host=false"
    for rendezvous in (first, second):
        assert rendezvous[rendezvous.index("--rdzv-endpoint") + 1] == "node0:29500"
        assert rendezvous[rendezvous.index("--rdzv-id") + 1] == "job-7"
        assert rendezvous[rendezvous.index("--nnodes") + 1] == "1:2"
