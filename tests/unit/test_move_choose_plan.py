"""Choosing the next plan knowing the move (elastic/moves/choose_plan.py), and the measured terms of
the predicted move time (elastic/moves/move_time.py), against hand-computed figures."""

from __future__ import annotations

import math

import pytest

from meshmorph.elastic.moves.choose_plan import rank_choices
from meshmorph.elastic.moves.layout import layout_of
from meshmorph.elastic.moves.move_plan import plan_move
from meshmorph.elastic.moves.move_time import MoveTimeModel, move_time
from meshmorph.elastic.moves.placement import ReshapeError
from meshmorph.spec.catalog import catalog_model
from meshmorph.spec.cluster import parse_cluster
from tests.unit.test_layout import plan_for

SLOW_LINK = MoveTimeModel(fixed_s=0.0, p2p_alpha_s=1e-3, p2p_beta_s_per_byte=1e-5)
"""100 kB/s: a move of a few MB costs seconds, as a large model's move does on real links."""


def _model():  # type: ignore[no-untyped-def]
    return catalog_model("gpt-tiny", seq_len=16)


def test_measured_terms_add_up_by_hand() -> None:
    model = _model()
    a = layout_of(model, plan_for(model, dp=2, global_batch=4, num_microbatches=2))
    b = layout_of(model, plan_for(model, dp=4, global_batch=4))
    move = plan_move(a, b, [0, 1])  # devices 2 and 3 join and receive everything
    terms = MoveTimeModel(fixed_s=0.01, p2p_alpha_s=2e-3, p2p_beta_s_per_byte=1e-8,
                          host_streams=1.5, checksum_bps=1e9, plan_s=0.02, group_s=0.03,
                          build_s=0.2, copy_bps=2e9)
    got = move_time(move, parse_cluster("cpu:1x4"), model=terms, groups=2,
                    install_bytes=10_000_000)
    sent, received = move.sent_bytes(), move.received_bytes()
    per_device = {d: (sent[d] + received[d]) * 1e-9
                  + max(sum(2e-3 + x.nbytes * 1e-8 for x in move.batches if x.src_device == d),
                        sum(2e-3 + x.nbytes * 1e-8 for x in move.batches if x.dst_device == d))
                  for d in move.devices}
    assert max(sent.values()) > 0 and max(received.values()) > 0
    host = sum(x.nbytes for x in move.batches) * 1e-8 / 1.5  # one host carries every message
    network = max(max(per_device.values()), host)
    assert got.network_s == pytest.approx(network, rel=1e-12)
    assert got.fixed_s == pytest.approx(0.01 + 0.02 + 2 * 0.03, rel=1e-12)
    assert got.rebuild_s == pytest.approx(0.2 + 10_000_000 / 2e9, rel=1e-12)
    assert got.total_s == pytest.approx(got.fixed_s + network + got.rebuild_s, rel=1e-12)


def test_the_fastest_plan_loses_when_its_move_costs_more_than_it_saves() -> None:
    model = _model()
    plan_a = plan_for(model, dp=2, zero=3, global_batch=8, num_microbatches=4)
    near = plan_for(model, dp=4, zero=3, global_batch=8, num_microbatches=2)  # the joiners take half the shards
    far = plan_for(model, tp=2, pp=2, global_batch=8, num_microbatches=8)  # everything moves
    # the planner's order: ``far`` is the faster plan per step
    candidates = [(far, 0.8), (near, 1.0)]
    by_plan = {c.plan: c for c in rank_choices(model, plan_a, candidates, survivors=[0, 1],
                                                steps_left=1, time_model=SLOW_LINK)}
    extra_move = by_plan[far].move_time_s - by_plan[near].move_time_s
    assert by_plan[far].bytes_moved > by_plan[near].bytes_moved and extra_move > 1.0
    # break-even: the 0.2 s a step saves, times the steps left, against the longer move
    even = extra_move / 0.2
    few, many = math.floor(even) - 1, math.ceil(even) + 1
    assert few >= 1
    best_few = rank_choices(model, plan_a, candidates, survivors=[0, 1], steps_left=few,
                            time_model=SLOW_LINK)
    best_many = rank_choices(model, plan_a, candidates, survivors=[0, 1], steps_left=many,
                             time_model=SLOW_LINK)
    assert best_few[0].plan == near and best_many[0].plan == far
    assert best_few[0].total_s == pytest.approx(by_plan[near].move_time_s + few * 1.0)
    # each candidate's move time is its MovePlan's predicted time
    move = plan_move(layout_of(model, plan_a), layout_of(model, far), [0, 1], [2, 3])
    assert by_plan[far].move_time_s == pytest.approx(
        move_time(move, parse_cluster("cpu:1x4"), model=SLOW_LINK).total_s, rel=1e-12)


def test_no_candidate_is_refused() -> None:
    model = _model()
    with pytest.raises(ReshapeError, match="no candidate plan"):
        rank_choices(model, plan_for(model, dp=2, global_batch=4, num_microbatches=2), [], survivors=[0, 1],
                     steps_left=3)


def test_the_surviving_ranks_need_not_be_the_first_ones() -> None:
    """A lost node whose ranks came first (old ranks 0 and 1): the survivors are 2 and 3, and the
    move is priced on a cluster that has their device numbers."""
    from meshmorph.elastic.moves.choose_plan import choose_plan
    from meshmorph.spec.catalog import load_model
    from meshmorph.spec.plan import Plan

    model = load_model("gpt-tiny", 32)
    plan_a = Plan(model="gpt-tiny", seq_len=32, global_batch=8, dp=4, zero=3, micro_batch=2,
                  num_microbatches=1, dtype="fp32").with_even_stages(model)
    first, last = (choose_plan(model, plan_a, 2, survivors=s, steps_left=4) for s in ([0, 1],
                                                                                     [2, 3]))
    assert first.plan.world_size == last.plan.world_size == 2
    assert last.plan == first.plan and last.bytes_moved > 0 and first.bytes_moved > 0
