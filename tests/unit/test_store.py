"""The node-local state store: atomic step files in a memory file system, newest common step,
round trip of pieces and small state, and the ring-copy interval from an overhead budget."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from meshmorph.elastic.live.local_state import HeldPiece, LocalState, SmallState
from meshmorph.elastic.live.store import (
    NodeStore,
    from_bytes,
    ring_interval_steps,
    ring_partner,
    to_bytes,
)


def _state(value: float, consumed: int = 16) -> LocalState:
    base = torch.full((6, 4), value)
    view = base[2:5]  # a view into larger storage, as an FSDP2 shard is
    piece = HeldPiece("param/embed.tok.weight", (2, 0), (6, 4), view)
    small = SmallState(step=2, param_group={"lr": 1e-3, "initial_lr": 1e-3},
                       lr_scheduler={"last_epoch": 2}, rng=torch.get_rng_state(),
                       consumed_samples=consumed)
    return LocalState({piece.key: [piece]}, small, "abc123")


def test_state_round_trips_through_bytes_with_its_box_and_small_state() -> None:
    back = from_bytes(to_bytes(3, 7, '{"dp": 4}', _state(1.5)))
    assert (back.rank, back.step, back.plan_json) == (3, 7, '{"dp": 4}')
    (piece,) = back.state.pieces["param/embed.tok.weight"]
    assert (piece.offset, piece.global_shape, piece.shape) == ((2, 0), (6, 4), (3, 4))
    assert torch.equal(piece.tensor, torch.full((3, 4), 1.5))
    assert piece.tensor.untyped_storage().nbytes() == 3 * 4 * 4  # the view alone was stored
    assert back.state.small.consumed_samples == 16 and back.state.small.step == 2


def test_store_keeps_the_newest_steps_and_finds_the_newest_common_one(tmp_path: Path) -> None:
    store = NodeStore("run/a b", 0, root=tmp_path, keep=2)
    for step in (1, 2, 3):
        store.save(0, step, "{}", _state(float(step)))
    store.save(1, 2, "{}", _state(2.0))
    assert store.steps() == {0: [2, 3], 1: [2]}
    assert store.newest_common_step([0, 1]) == 2
    assert store.newest_common_step([0]) == 3
    assert store.newest_common_step([0, 5]) is None
    loaded = store.load(0, 3).state.pieces["param/embed.tok.weight"][0].tensor
    assert float(loaded[0, 0]) == 3.0
    assert store.dir == tmp_path / "meshmorph-run_a_b" / "node0"
    assert not list(store.dir.glob("*.partial"))  # written under a temporary name, renamed


def test_a_write_cut_short_leaves_the_previous_step_loadable(tmp_path: Path) -> None:
    store = NodeStore("r", 1, root=tmp_path)
    store.save(0, 4, "{}", _state(4.0))
    (store.dir / ".rank0-step5.999.partial").write_bytes(b"half")  # a worker killed mid-write
    assert store.newest_common_step([0]) == 4
    with pytest.raises(FileNotFoundError, match=r"no state of rank 0 at step 5 \(it holds "
                                                r"\{0: \[4\]\}\); recover from the ring copy"):
        store.load(0, 5)


def test_ring_interval_meets_the_overhead_budget() -> None:
    # 1 GB over 10 GB/s = 0.1 s per copy; 2 % of a 0.5 s step is 0.01 s per step -> every 10 steps
    assert ring_interval_steps(10**9, 10e9, 0.5, overhead_budget=0.02) == 10
    assert ring_interval_steps(10**6, 10e9, 0.5) == 1
    assert ring_partner(2, 3) == 0 and ring_partner(0, 1) is None
    with pytest.raises(ValueError, match="overhead_budget"):
        ring_interval_steps(1, 1.0, 1.0, overhead_budget=0)
