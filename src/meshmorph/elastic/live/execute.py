"""Execute a MovePlan's transfers between the processes of one gloo (or NCCL) process group.

Every device runs ``execute_transfers`` with the same transfer list. Transfers are grouped per
(source, destination) pair; each pair's pieces travel as one flat message (the boxes' values,
concatenated) followed by its checksum (CRC-32 of the message's bytes, ``zlib.crc32``, about
2.5 GB/s on one CPU core: every piece is covered by its message's checksum), exchanged with one
``torch.distributed.batch_isend_irecv`` per round. Pairs are packed into rounds so that
no device receives more than ``staging_bytes`` in one round (a pair larger than the bound goes
alone); every device computes the same rounds from the same list, so sends and receives match.

Nothing here touches an engine: the sender reads the pieces its old engine holds (views), the
receiver keeps what arrives as new pieces beside its old ones, and the new engine is filled from
both only after every transfer has arrived and been checked (``local_state.install_state``). A
failure part-way (a dead peer, a checksum that does not match) raises before anything is
installed, so the old state is still whole.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from meshmorph.elastic.live.local_state import HeldPiece, ReshapeError
from meshmorph.elastic.moves.box import Box

TENSOR_KINDS = ("param/", "exp_avg/", "exp_avg_sq/")
"""Keys whose pieces travel as tensors; the small state (step, LR schedule, data, RNG) travels
as an object (``controller.share_small_state``)."""


class TransferLike(Protocol):
    """What the executor reads of a ``move_plan.Transfer``."""

    src_device: int
    dst_device: int
    key: str
    box: Box


@dataclass(frozen=True, slots=True)
class ExecutionReport:
    """What one device did during a move."""

    sent_bytes: int
    """Bytes this device sent."""
    received_bytes: int
    """Bytes this device received."""
    messages: int
    """Point-to-point messages this device took part in (payload and checksums)."""
    rounds: int
    """Rounds of the whole move (the same on every device)."""
    time_s: float
    """Wall time of this device's part, first round to last."""


def is_tensor_key(key: str) -> bool:
    return key.startswith(TENSOR_KINDS)


def rounds_of(transfers: Sequence[TransferLike], staging_bytes: int,
              elem_bytes: int = 4) -> list[list[tuple[int, int]]]:
    """(src, dst) pairs per round: each device receives at most ``staging_bytes`` per round (a
    pair over the bound goes alone); pairs in sorted order, first fit."""
    per_pair: dict[tuple[int, int], int] = {}
    for t in transfers:
        if t.src_device != t.dst_device and is_tensor_key(t.key):
            pair = (t.src_device, t.dst_device)
            per_pair[pair] = per_pair.get(pair, 0) + t.box.numel * elem_bytes
    rounds: list[list[tuple[int, int]]] = []
    loads: list[dict[int, int]] = []  # per round: bytes each destination receives
    for pair in sorted(per_pair):
        size, dst = per_pair[pair], pair[1]
        for members, load in zip(rounds, loads, strict=True):
            if load.get(dst, 0) + size <= staging_bytes:
                members.append(pair)
                load[dst] = load.get(dst, 0) + size
                break
        else:  # a new round (alone there if it is over the bound by itself)
            rounds.append([pair])
            loads.append({dst: size})
    return rounds


def crc32(tensor: torch.Tensor) -> int:
    """CRC-32 of a tensor's bytes (a copy to host memory first where it lives on a GPU)."""
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return zlib.crc32(flat.contiguous().view(torch.uint8).numpy())


def _find(pieces: Mapping[str, list[HeldPiece]], key: str, box: Box) -> HeldPiece:
    for piece in pieces.get(key, []):
        if Box(piece.offset, piece.shape).contains(box):
            return piece
    raise ReshapeError(f"the move plan has this device send {key} {box}, but it holds "
                       f"{[str(Box(p.offset, p.shape)) for p in pieces.get(key, [])]}; the "
                       "Layout and the live engine disagree")


def _slice(piece: HeldPiece, box: Box) -> torch.Tensor:
    local = tuple(slice(o - p, o - p + n) for o, n, p in
                  zip(box.offset, box.length, piece.offset, strict=True))
    return piece.tensor[local] if local else piece.tensor


def execute_transfers(transfers: Iterable[TransferLike], me: int,
                      held: Mapping[str, list[HeldPiece]], global_shapes: Mapping[str, tuple],
                      *, rank_of_device: Mapping[int, int], staging_bytes: int = 256 << 20,
                      group: dist.ProcessGroup | None = None, verify: bool = True,
                      dtype: torch.dtype = torch.float32) -> tuple[list[HeldPiece], ExecutionReport]:
    """Run the tensor transfers of a move on device ``me``; returns the pieces it received (new
    tensors) and what it did. ``held`` is what ``me`` holds now (by key), ``global_shapes`` the
    whole shape of every key, ``rank_of_device`` the rank of each device in ``group``."""
    moves = [t for t in transfers if is_tensor_key(t.key) and t.src_device != t.dst_device]
    by_pair: dict[tuple[int, int], list[TransferLike]] = {}
    for t in moves:
        by_pair.setdefault((t.src_device, t.dst_device), []).append(t)
    rounds = rounds_of(moves, staging_bytes, torch.tensor([], dtype=dtype).element_size())
    received: list[HeldPiece] = []
    sent = got = messages = 0
    start = time.perf_counter()
    for members in rounds:
        ops: list[dist.P2POp] = []
        inbox: list[tuple[list[TransferLike], torch.Tensor, torch.Tensor]] = []
        for src, dst in members:
            if me not in (src, dst):
                continue
            batch = by_pair[(src, dst)]
            if me == src:
                parts = [_slice(_find(held, t.key, t.box), t.box) for t in batch]
                flat = torch.cat([p.reshape(-1) for p in parts]) if parts \
                    else torch.empty(0, dtype=dtype)
                sums = torch.tensor([crc32(flat) if verify else 0], dtype=torch.int64)
                ops += [dist.P2POp(dist.isend, flat, rank_of_device[dst], group),
                        dist.P2POp(dist.isend, sums, rank_of_device[dst], group)]
                sent += flat.numel() * flat.element_size()
            else:
                flat = torch.empty(sum(t.box.numel for t in batch), dtype=dtype)
                sums = torch.empty(1, dtype=torch.int64)
                ops += [dist.P2POp(dist.irecv, flat, rank_of_device[src], group),
                        dist.P2POp(dist.irecv, sums, rank_of_device[src], group)]
                inbox.append((batch, flat, sums))
                got += flat.numel() * flat.element_size()
            messages += 2
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        for batch, flat, sums in inbox:
            if verify and crc32(flat) != int(sums[0]):
                pieces = ", ".join(f"{t.key} {t.box}" for t in batch[:3])
                raise ReshapeError(f"the message from device {batch[0].src_device} ({pieces}"
                                   f"{'...' if len(batch) > 3 else ''}) arrived with another "
                                   "checksum than it left with; the old state is intact: retry "
                                   "the move or resume from it")
            at = 0
            for t in batch:
                value = flat[at:at + t.box.numel].view(t.box.length)
                at += t.box.numel
                received.append(HeldPiece(t.key, t.box.offset, tuple(global_shapes[t.key]),
                                          value))
    report = ExecutionReport(sent, got, messages, len(rounds), time.perf_counter() - start)
    return received, report


def merge_pieces(*sources: Mapping[str, list[HeldPiece]] | list[HeldPiece]
                 ) -> dict[str, list[HeldPiece]]:
    """One dict of pieces by key from dicts and lists of pieces."""
    out: dict[str, list[HeldPiece]] = {}
    for source in sources:
        items: Any = source.values() if isinstance(source, Mapping) else [source]
        for pieces in items:
            for piece in pieces:
                out.setdefault(piece.key, []).append(piece)
    return out
