"""The predicted move time: alpha + bytes / beta per message over the link between the two
devices, the busiest direction of the busiest device, plus the fixed cost (hand-computed)."""

from __future__ import annotations

import pytest

from meshmorph.cost.coefficients import CostCoefficients
from meshmorph.elastic.moves.layout import layout_of
from meshmorph.elastic.moves.move_plan import plan_move
from meshmorph.elastic.moves.move_time import MoveTimeModel, move_time, node_of, predict_move_time_s
from meshmorph.spec.catalog import catalog_model
from meshmorph.spec.cluster import parse_cluster
from tests.unit.test_layout import plan_for

EFFICIENCY = CostCoefficients().link_efficiency  # the cost model's achieved fraction of nominal
NDR = 400 / 8 * 1e9 * EFFICIENCY  # ib-ndr per GPU
NVLINK4 = 450e9 * EFFICIENCY


def _replicas_to_four():  # type: ignore[no-untyped-def]
    model = catalog_model("gpt-tiny", seq_len=16)
    a = layout_of(model, plan_for(model, dp=2, global_batch=4, num_microbatches=2))
    b = layout_of(model, plan_for(model, dp=4, global_batch=4))
    return plan_move(a, b, [0, 1])  # devices 2 and 3 join and receive everything


def test_joining_node_is_fed_over_the_inter_node_link() -> None:
    move = _replicas_to_four()
    cluster = parse_cluster("h100:2x2")  # devices 0, 1 on node 0; 2, 3 on node 1
    assert [node_of(cluster, d) for d in range(4)] == [0, 0, 1, 1]
    sent, received = move.sent_bytes(), move.received_bytes()
    messages = {d: sum(1 for b in move.batches if d in (b.src_device, b.dst_device))
                for d in move.devices}
    hand = max(messages[d] * 5e-6 + max(sent[d], received[d]) / NDR for d in move.devices)
    assert move.messages == 4 and all(messages[d] == 2 for d in move.devices)
    assert predict_move_time_s(move, cluster) == pytest.approx(0.05 + hand, rel=1e-12)
    one_node = predict_move_time_s(move, parse_cluster("h100:1x4"),
                                   model=MoveTimeModel(fixed_s=0.0))
    assert one_node == pytest.approx(2 * 4e-6 + max(sent.values()) / NVLINK4, rel=1e-12)


def test_checkpoint_reads_are_priced_at_storage_bandwidth() -> None:
    model = catalog_model("gpt-tiny", seq_len=16)
    a = layout_of(model, plan_for(model, dp=2, zero=3, global_batch=2))
    b = layout_of(model, plan_for(model, global_batch=2, num_microbatches=2))
    move = plan_move(a, b, [0])  # rank 1's shards are lost with it
    terms = move_time(move, parse_cluster("h100:1x2"), model=MoveTimeModel(storage_read_bps=1e6))
    assert move.network_bytes == 0 and terms.network_s == 0.0
    assert terms.checkpoint_s == pytest.approx(move.checkpoint_bytes / 1e6, rel=1e-12)
    assert terms.total_s == pytest.approx(0.05 + terms.checkpoint_s, rel=1e-12)


def test_a_device_outside_the_cluster_is_refused() -> None:
    with pytest.raises(ValueError, match="outside the cluster's 2 devices"):
        predict_move_time_s(_replicas_to_four(), parse_cluster("h100:1x2"))
