"""MovePlan: the transfers that turn Layout A into Layout B on the devices still alive, with the
fewest bytes, the busiest sender sending as little as possible, batched under a staging bound.

``plan_move``: the receive matrix and ``linear_sum_assignment`` give the placement, whose total
is the lower bound (placement.py); each needed region is cut into cells with a definite set of
live senders (box_cells.py); a linear program (HiGHS) splits each sender set's bytes to
minimise the busiest sender, and cells are cut by rows where it says (at most one row over the
LP optimum per cut). Every needed byte is sent once: ``bytes_moved`` equals
``lower_bound_bytes`` (the tests check it).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from meshmorph.elastic.moves.box import Box
from meshmorph.elastic.moves.box_cells import cover
from meshmorph.elastic.moves.layout import DTYPE_BYTES, Layout
from meshmorph.elastic.moves.placement import (
    ReshapeError,
    assign_cells,
    balance_senders,
    best_placement,
    device_holdings,
    moved_keys,
    placement_bytes,
    rank_order_placement,
    receive_matrix,
)

FROM_CHECKPOINT = -1
"""``src_device`` of a transfer read from the newest committed checkpoint."""
DEFAULT_STAGING_BYTES = 256 * 2**20
"""Largest batch a destination buffers before placing it (256 MiB)."""


@dataclass(frozen=True, slots=True)
class Transfer:
    """One box of one state tensor sent from a device to another."""

    src_device: int
    """Sending device (``FROM_CHECKPOINT`` = -1: read from the checkpoint)."""
    dst_device: int
    """Receiving device."""
    key: str
    """Key of the StateTensor."""
    box: Box
    """The elements sent, in the tensor's global coordinates."""
    nbytes: int
    """Bytes sent."""


@dataclass(frozen=True, slots=True)
class Batch:
    """Transfers sent as one message between one (source, destination) pair."""

    src_device: int
    """Sending device."""
    dst_device: int
    """Receiving device."""
    transfers: tuple[Transfer, ...]
    """What the message holds, in order."""

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.transfers)


def _fit(transfer: Transfer, staging_bytes: int) -> list[Transfer]:
    """``transfer`` cut along dim 0 into parts of at most ``staging_bytes``."""
    if transfer.nbytes <= staging_bytes:
        return [transfer]
    box = transfer.box
    size = transfer.nbytes // box.numel  # bytes per element
    row = size * box.row_numel()
    rows = staging_bytes // row
    if box.ndim == 0 or rows < 1:
        raise ValueError(f"staging_bytes {staging_bytes} is below one row ({row} bytes) of "
                         f"{transfer.key}; raise staging_bytes to at least {row}")
    parts = []
    while box.length[0] > rows:
        head, box = box.split_rows(rows)
        parts.append(replace(transfer, box=head, nbytes=head.numel * size))
    return [*parts, replace(transfer, box=box, nbytes=box.numel * size)]


def batch_transfers(transfers: Sequence[Transfer], staging_bytes: int) -> tuple[Batch, ...]:
    """Transfers grouped per (source, destination) pair in key order, each group packed into
    batches of at most ``staging_bytes`` (a transfer larger than that is cut by rows)."""
    if staging_bytes < 1:
        raise ValueError(f"staging_bytes must be at least 1, got {staging_bytes}")
    pairs: dict[tuple[int, int], list[Transfer]] = defaultdict(list)
    for t in transfers:
        pairs[t.src_device, t.dst_device].append(t)
    batches = []
    for (src, dst), group in sorted(pairs.items()):
        current: list[Transfer] = []
        size = 0
        for t in sorted(group, key=lambda t: (t.key, t.box.offset)):
            for part in _fit(t, staging_bytes):
                if current and size + part.nbytes > staging_bytes:
                    batches.append(Batch(src, dst, tuple(current)))
                    current, size = [], 0
                current.append(part)
                size += part.nbytes
        if current:
            batches.append(Batch(src, dst, tuple(current)))
    return tuple(batches)


@dataclass(frozen=True, slots=True, kw_only=True)
class MovePlan:
    """Everything a reshape moves, where, and what it costs in bytes."""

    placement: dict[int, int]
    """New logical rank -> physical device (device ids are old ranks for survivors)."""
    devices: tuple[int, ...]
    """Physical devices taking part: the survivors, then the joining devices."""
    survivors: tuple[int, ...]
    """Old ranks still alive (they hold their Layout A pieces)."""
    batches: tuple[Batch, ...]
    """Transfers between live devices, batched per (source, destination) pair."""
    local_copies: tuple[Transfer, ...]
    """Parts a device already holds and keeps (``src_device == dst_device``; not moved)."""
    from_checkpoint: tuple[Transfer, ...]
    """Parts no live device holds (``src_device == FROM_CHECKPOINT``)."""
    fresh_keys: tuple[str, ...]
    """Keys of Layout B that Layout A has no tensor for (created, not moved)."""
    lower_bound_bytes: int
    """Bytes every device must receive at least, under the best placement."""
    naive_placement: dict[int, int]
    """New rank ``r`` on the ``r``-th device in id order (Megatron-style)."""
    naive_bytes: int
    """Bytes the naive placement would have to receive."""
    staging_bytes: int
    """Bound on the bytes of one batch."""

    @property
    def transfers(self) -> tuple[Transfer, ...]:
        """Every transfer between live devices."""
        return tuple(t for batch in self.batches for t in batch.transfers)

    @property
    def network_bytes(self) -> int:
        return sum(batch.nbytes for batch in self.batches)

    @property
    def checkpoint_bytes(self) -> int:
        return sum(t.nbytes for t in self.from_checkpoint)

    @property
    def bytes_moved(self) -> int:
        """Bytes delivered to devices: from other devices plus from the checkpoint."""
        return self.network_bytes + self.checkpoint_bytes

    @property
    def messages(self) -> int:
        """Point-to-point messages (one per batch)."""
        return len(self.batches)

    def sent_bytes(self) -> dict[int, int]:
        """Bytes each device sends."""
        sent = dict.fromkeys(self.devices, 0)
        for batch in self.batches:
            sent[batch.src_device] += batch.nbytes
        return sent

    def received_bytes(self) -> dict[int, int]:
        """Bytes each device receives (checkpoint reads included)."""
        received = dict.fromkeys(self.devices, 0)
        for t in (*self.transfers, *self.from_checkpoint):
            received[t.dst_device] += t.nbytes
        return received

    def link_bytes(self) -> dict[tuple[int, int], int]:
        """Bytes per (source, destination) pair."""
        links: dict[tuple[int, int], int] = defaultdict(int)
        for batch in self.batches:
            links[batch.src_device, batch.dst_device] += batch.nbytes
        return dict(sorted(links.items()))

    @property
    def busiest_device_bytes(self) -> int:
        """The most bytes one device sends or receives (links are full duplex)."""
        return max([0, *self.sent_bytes().values(), *self.received_bytes().values()])


def _check(layout_a: Layout, layout_b: Layout, survivors: Sequence[int],
           new_devices: Sequence[int]) -> None:
    a, b = layout_a.plan, layout_b.plan
    if layout_a.model != layout_b.model:
        raise ReshapeError(f"plan A is for model {layout_a.model.name!r} and plan B for "
                           f"{layout_b.model.name!r}; a reshape keeps the model: make both plans "
                           "for the same model and sequence length")
    if a.global_batch != b.global_batch:
        raise ReshapeError(f"plan B's global_batch {b.global_batch} differs from plan A's "
                           f"{a.global_batch}; a reshape keeps the training math: choose "
                           f"micro_batch x num_microbatches = {a.global_batch} / dp")
    if not survivors:
        raise ReshapeError("no survivors given; name at least one old rank still alive "
                           "(or restart from the checkpoint)")
    bad = [r for r in survivors if not 0 <= r < layout_a.world_size]
    if bad:
        raise ReshapeError(f"survivors {bad} are outside the old plan's ranks "
                           f"0..{layout_a.world_size - 1}")
    if len(set(survivors)) != len(survivors):
        raise ReshapeError(f"survivors {list(survivors)} list a rank twice")
    clash = sorted(set(new_devices) & set(survivors)) + [d for d in new_devices if d < 0]
    if clash or len(set(new_devices)) != len(new_devices):
        raise ReshapeError(f"new devices {list(new_devices)} must be distinct ids >= 0 that are "
                           f"not survivors (clash: {clash})")


def plan_move(layout_a: Layout, layout_b: Layout, survivors: Sequence[int],
              new_devices: Sequence[int] | None = None, *,
              staging_bytes: int = DEFAULT_STAGING_BYTES,
              placement: Mapping[int, int] | None = None,
              hosts: Sequence[int] | None = None) -> MovePlan:
    """The MovePlan from ``layout_a`` (on its ranks ``survivors``, still alive) to ``layout_b``.

    ``new_devices``: ids of devices that join holding nothing (default: as many as Layout B
    lacks, numbered from Layout A's world size). ``hosts``: the devices that may run a rank of
    Layout B (default: every survivor and new device); a planned leave lists the devices that
    stay, while the leaving ones still send what they hold. The best placement, the naive one and
    the lower bound are all taken over ``hosts``. ``placement`` forces new rank -> device; by
    default the best placement is taken."""
    if new_devices is None:
        extra = max(0, layout_b.world_size - len(survivors))
        new_devices = list(range(layout_a.world_size, layout_a.world_size + extra))
    _check(layout_a, layout_b, survivors, new_devices)
    devices = tuple(sorted(survivors)) + tuple(new_devices)
    holdings = device_holdings(layout_a, devices, survivors)
    receive = receive_matrix(layout_a, layout_b, holdings)
    hosting = tuple(d for d in devices if hosts is None or d in set(hosts))
    if hosts is not None and len(hosting) != len(set(hosts)):
        raise ReshapeError(f"hosts {list(hosts)} must be devices of {list(devices)}")
    receive = receive[:, [devices.index(d) for d in hosting]]
    best = best_placement(receive, hosting)
    naive = rank_order_placement(layout_b, hosting)
    chosen = dict(placement) if placement is not None else best
    if sorted(chosen) != list(range(layout_b.world_size)) or \
            len(set(chosen.values())) != len(chosen) or not set(chosen.values()) <= set(hosting):
        raise ReshapeError(f"placement {chosen} must put each of the new plan's "
                           f"{layout_b.world_size} ranks on its own device of {list(hosting)}")
    keys = moved_keys(layout_a, layout_b)
    held_by = dict(zip(devices, holdings, strict=True))
    sources: dict[str, list[tuple[int, Box]]] = defaultdict(list)
    for device, held in held_by.items():
        for key, box in held.items():
            sources[key].append((device, box))
    local, checkpoint, fresh = [], [], set()
    covers: dict[tuple[str, Box], list[tuple[Box, frozenset[int]]]] = {}
    groups: dict[frozenset[int], list[tuple[int, str, Box, int]]] = defaultdict(list)
    for rank, dst in sorted(chosen.items()):
        for piece in layout_b.held[rank]:
            if piece.key not in keys:
                fresh.add(piece.key)
                continue
            size = DTYPE_BYTES[layout_b.tensors[piece.key].dtype]
            own = held_by[dst].get(piece.key)
            common = piece.box.intersect(own) if own is not None else None
            if common is not None:
                local.append(Transfer(dst, dst, piece.key, common, common.numel * size))
            for needed in piece.box.minus(own):
                # ``needed`` misses ``dst``'s own box, so every holder's cover is the same
                if (piece.key, needed) not in covers:
                    covers[piece.key, needed] = cover(needed, sources[piece.key])
                for cell, who in covers[piece.key, needed]:
                    if who:
                        groups[who].append((dst, piece.key, cell, size))
                    else:
                        checkpoint.append(Transfer(FROM_CHECKPOINT, dst, piece.key, cell,
                                                   cell.numel * size))
    shares = balance_senders({g: sum(c.numel * s for _, _, c, s in cells) for g, cells in groups.items()})
    sent = [Transfer(*item) for g, cells in groups.items() for item in assign_cells(cells, shares[g])]
    return MovePlan(placement=chosen, devices=devices, survivors=tuple(sorted(survivors)),
                    batches=batch_transfers(sent, staging_bytes), local_copies=tuple(local),
                    from_checkpoint=tuple(checkpoint), fresh_keys=tuple(sorted(fresh)),
                    lower_bound_bytes=placement_bytes(receive, hosting, best),
                    naive_placement=naive, naive_bytes=placement_bytes(receive, hosting, naive),
                    staging_bytes=staging_bytes)
