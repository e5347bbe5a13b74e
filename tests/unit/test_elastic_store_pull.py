"""Which step the restarted workers restore, which old rank each takes up, and which stored files
a worker must pull from another node (the pure half of ``store_pull`` and ``restore_state``)."""

from __future__ import annotations

from meshmorph.elastic.live.restore_state import old_ranks_read
from meshmorph.elastic.live.store_pull import Inventory, claim_old_ranks, common_step
from meshmorph.spec.catalog import load_model
from meshmorph.spec.plan import Plan


def _inv(rank: int, node: int, local: int, own: dict, ring: dict | None = None) -> Inventory:
    return Inventory(rank, node, local, own, ring or {})


def test_common_step_needs_every_old_rank_on_some_node_own_or_ring() -> None:
    node0 = {0: [3, 4], 1: [3, 4]}
    ring_of_node1 = {2: [2, 3], 3: [2, 3]}  # copied every other step
    invs = [_inv(0, 0, 0, node0, ring_of_node1), _inv(1, 0, 1, node0, ring_of_node1)]
    assert common_step(invs, 4) == 3  # step 4 of ranks 2 and 3 died with node 1
    assert common_step(invs, 2) == 4
    assert common_step([_inv(0, 0, 0, node0)], 4) is None


def test_survivors_keep_their_ranks_and_a_blank_node_takes_up_the_lost_ones() -> None:
    node0 = {0: [5], 1: [5]}
    invs = [_inv(0, 0, 0, node0), _inv(1, 0, 1, node0), _inv(2, 1, 0, {}), _inv(3, 1, 1, {})]
    assert claim_old_ranks(invs, 5, 4) == {0: 0, 1: 1, 2: 2, 3: 3}
    # the surviving node came back with group ranks 2 and 3: its workers keep old ranks 2 and 3
    node1 = {2: [5], 3: [5]}
    invs = [_inv(0, 0, 0, {}), _inv(1, 0, 1, {}), _inv(2, 1, 0, node1), _inv(3, 1, 1, node1)]
    assert claim_old_ranks(invs, 5, 4) == {2: 2, 3: 3, 0: 0, 1: 1}
    # shrink to the survivors: nobody is left to take up ranks 2 and 3 (their pieces are read)
    assert claim_old_ranks(invs[2:], 5, 4) == {2: 2, 3: 3}


def test_a_worker_reads_its_node_first_and_pulls_only_what_its_node_lacks() -> None:
    model = load_model("gpt-tiny", 32)
    zero3 = Plan(model="gpt-tiny", seq_len=32, global_batch=8, dp=4, zero=3, micro_batch=2,
                 num_microbatches=1, dtype="fp32").with_even_stages(model)
    dp2 = Plan(model="gpt-tiny", seq_len=32, global_batch=8, dp=2, zero=3, micro_batch=2,
               num_microbatches=2, dtype="fp32").with_even_stages(model)
    # ZeRO-3 over 4 -> over 2: new rank 0 needs rows of old ranks 0 and 1 (a dim-0 half)
    assert sorted(old_ranks_read(model, zero3, dp2, new_rank=0, old_rank=0,
                                 local={0, 1, 2, 3})) == [0, 1]
    assert sorted(old_ranks_read(model, zero3, dp2, new_rank=1, old_rank=1,
                                 local={0, 1, 2, 3})) == [1, 2, 3]
    # the same plan: a worker taking up old rank 2 reads that rank alone
    assert old_ranks_read(model, zero3, zero3, new_rank=2, old_rank=2, local=set()) == [2]
    # replicated state (dp without ZeRO) is read from the node's own copy, not pulled
    dp4 = Plan(model="gpt-tiny", seq_len=32, global_batch=8, dp=4, zero=0, micro_batch=2,
               num_microbatches=1, dtype="fp32").with_even_stages(model)
    assert old_ranks_read(model, dp4, dp4, new_rank=2, old_rank=None, local={0, 1}) == [0]
