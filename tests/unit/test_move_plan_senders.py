"""The busiest sender of a MovePlan sends the least any choice of sources can give, up to one row
per sender group: compared with the exact optimum of the splittable problem, which (max-flow
min-cut, Hall's condition) is ``max over sender sets S of bytes only S can send / |S|``, found
by brute force over every S."""

from __future__ import annotations

import itertools

from hypothesis import given, settings

from meshmorph.elastic.moves.layout import Layout, layout_of
from meshmorph.elastic.moves.move_plan import plan_move
from meshmorph.spec.catalog import catalog_model
from tests.unit.test_layout import plan_for
from tests.unit.test_move_plan import reshapes


def hall_optimum_and_slack(move, a: Layout) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    """(the splittable optimum of the busiest sender's bytes, one row per sender set)."""
    demand: dict[frozenset[int], int] = {}
    row = 0
    for t in move.transfers:
        who = frozenset(d for d in move.survivors if d != t.dst_device
                        and (p := a.piece(d, t.key)) is not None and p.box.contains(t.box))
        assert t.src_device in who
        demand[who] = demand.get(who, 0) + t.nbytes
        row = max(row, t.nbytes // max(1, t.box.length[0] if t.box.ndim else 1))
    senders = sorted(set().union(*demand)) if demand else []
    best = 0.0
    for size in range(1, len(senders) + 1):
        for subset in itertools.combinations(senders, size):
            inside = sum(n for who, n in demand.items() if who <= set(subset))
            best = max(best, inside / size)
    return best, row * len(demand)


@settings(max_examples=60, deadline=None)
@given(reshapes())
def test_busiest_sender_is_the_splittable_optimum_within_a_row_per_group(case) -> None:  # type: ignore[no-untyped-def]
    a, b, survivors = case
    move = plan_move(a, b, survivors)
    optimum, slack = hall_optimum_and_slack(move, a)
    busiest = max(move.sent_bytes().values(), default=0)
    assert optimum - 1e-6 <= busiest <= optimum + slack


def test_four_replicas_feeding_four_joining_devices_send_a_quarter_each() -> None:
    model = catalog_model("gpt-tiny", seq_len=16)
    a = layout_of(model, plan_for(model, dp=4, global_batch=8, num_microbatches=2))
    b = layout_of(model, plan_for(model, dp=8, global_batch=8))
    move = plan_move(a, b, [0, 1, 2, 3])
    optimum, slack = hall_optimum_and_slack(move, a)
    sent = move.sent_bytes()
    assert optimum == move.network_bytes / 4
    assert max(sent.values()) - min(sent[d] for d in (0, 1, 2, 3)) <= slack
    assert max(sent.values()) <= optimum + slack < 1.01 * optimum
