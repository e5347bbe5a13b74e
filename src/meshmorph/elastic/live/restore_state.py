"""Rebuild a job's state after workers restart, from the node-local store, under a new Plan.

A node's store is in its shared memory, so each of its workers can read any of its old ranks'
files: for each piece Layout B gives it, a new rank reads the overlapping boxes of the old ranks
Layout A says held them (its own old file first, then the lowest old rank) and fills its new
engine from them (``install_state``). Old ranks whose files are not on this node come from the
ring copy (``NodeStore.replicas``); with neither, the way out is the newest checkpoint.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from meshmorph.elastic.live.execute import is_tensor_key
from meshmorph.elastic.live.local_state import HeldPiece, ReshapeError, SmallState, install_state
from meshmorph.elastic.live.store import NodeStore, StoredState, newest_common
from meshmorph.elastic.moves.box import Box
from meshmorph.elastic.moves.layout import Layout, layout_of
from meshmorph.spec.model import ModelSpec
from meshmorph.spec.plan import Plan


@dataclass(slots=True)
class RestoreReport:
    """Where one new rank's state came from."""

    step: int
    """The step the state was stored at (training continues from it)."""
    bytes_from: dict[str, int] = field(default_factory=dict)
    """Bytes read per source: ``own`` (this rank's old file), ``node-rank<r>`` (another old
    rank's file on this node), ``ring-rank<r>`` (the ring copy of another node's rank)."""
    time_s: float = 0.0
    """Wall time of reading and installing."""
    consumed_samples: int = 0
    """The data position stored with the state."""


def _find(store: NodeStore, rank: int, step: int) -> tuple[StoredState, str]:
    if store.path(rank, step).is_file():
        return store.load(rank, step), "node"
    if store.path(rank, step, store.replicas).is_file():
        return store.load(rank, step, store.replicas), "ring"
    raise ReshapeError(f"no copy of old rank {rank}'s state at step {step} in the node store "
                       f"{store.dir} or its ring copy; restart from the newest checkpoint "
                       "(meshmorph run --resume --reshard)")


def _order(old_rank: int | None, local: set[int] | None) -> Any:
    """Holders read first: this worker's old rank, then ranks its node holds, then the lowest."""
    return lambda held: (held[0] != old_rank, local is not None and held[0] not in local,
                         held[0])


def _sources(layout_a: Layout, key: str, box: Box, order: Any) -> Iterator[tuple[int, list[Box]]]:
    """(old rank, the parts of ``box`` read from it) for Plan A's holders of ``key`` in
    ``order``, each until ``box`` is covered."""
    remaining = [box]
    for rank, held in sorted(layout_a.holders(key), key=order):
        if not remaining:
            return
        parts = [common for part in remaining if (common := part.intersect(held)) is not None]
        if parts:
            yield rank, parts
            remaining = [rest for part in remaining for rest in part.minus(held)]
    if remaining:
        raise ReshapeError(f"{key} {remaining[0]} is held by no old rank of plan A; the stored "
                           "plan and this model disagree")


def old_ranks_read(model: ModelSpec, plan_a: Plan, plan_b: Plan, *, new_rank: int,
                   old_rank: int | None, local: set[int]) -> list[int]:
    """The old ranks whose stored files ``restore_from_store`` reads for ``new_rank`` when its
    node holds those of ``local`` (the others must be pulled from another node first)."""
    layout_a = layout_of(model, plan_a)
    read: list[int] = []
    for piece in layout_of(model, plan_b).held[new_rank]:
        if is_tensor_key(piece.key) and piece.box.numel:
            read += [rank for rank, _ in _sources(layout_a, piece.key, piece.box,
                                                  _order(old_rank, local)) if rank not in read]
    if old_rank is not None and old_rank not in read:
        read.append(old_rank)  # its small state (step, schedule, RNG stream)
    return read


def restore_from_store(store: NodeStore, *, new_rank: int, old_rank: int | None, step: int,
                       model: ModelSpec, plan_b: Plan, engine: Any, plan_a: Plan | None = None,
                       pulled: dict[int, tuple[StoredState, str]] | None = None,
                       local_ranks: set[int] | None = None) -> RestoreReport:
    """Fill ``engine`` (Plan B, rank ``new_rank``, freshly built) from the state the old ranks
    stored at ``step``; ``old_rank`` is the rank this worker takes up (None: it joined).
    ``pulled``: old rank -> (state, source) already fetched from another node
    (``store_pull.pull_files``); ``local_ranks``: the old ranks this node holds (read before
    the others)."""
    start = time.perf_counter()
    report = RestoreReport(step)
    loaded: dict[int, tuple[StoredState, str]] = dict(pulled or {})
    if plan_a is None:
        first_rank = old_rank if old_rank is not None else 0
        if first_rank not in loaded:
            loaded[first_rank] = _find(store, first_rank, step)
        plan_a = Plan.from_json(loaded[first_rank][0].plan_json)
    first = next(iter(loaded.values()), None)
    layout_a, layout_b = layout_of(model, plan_a), layout_of(model, plan_b)
    pieces: dict[str, list[HeldPiece]] = {}
    for piece in layout_b.held[new_rank]:
        if not is_tensor_key(piece.key) or not piece.box.numel:
            continue
        for rank, parts in _sources(layout_a, piece.key, piece.box,
                                    _order(old_rank, local_ranks)):
            if rank not in loaded:
                loaded[rank] = _find(store, rank, step)
            stored, where = loaded[rank]
            source = "own" if rank == old_rank and where == "node" else f"{where}-rank{rank}"
            (held,) = stored.state.pieces[piece.key]
            for common in parts:
                local = common.slices_from(held.offset)
                value = held.tensor[local] if local else held.tensor
                pieces.setdefault(piece.key, []).append(
                    HeldPiece(piece.key, common.offset, held.global_shape, value))
                report.bytes_from[source] = report.bytes_from.get(source, 0) + \
                    value.numel() * value.element_size()
    if old_rank is not None and old_rank not in loaded:
        loaded[old_rank] = _find(store, old_rank, step)
    own = loaded.get(old_rank) if old_rank is not None else None
    small: SmallState = (own or first or next(iter(loaded.values())))[0].state.small
    if own is None:
        small = replace(small, rng=torch.get_rng_state())
    install_state(engine, pieces, small)
    report.consumed_samples = small.consumed_samples
    report.time_s = time.perf_counter() - start
    return report


def restore_step(store: NodeStore, old_ranks: list[int]) -> int | None:
    """The newest step every old rank stored on this node (or in its ring copy)."""
    return newest_common(old_ranks, store.steps(), store.steps(store.replicas))

