"""Execute a MovePlan's transfers between the processes of one process group.

Every device runs ``execute_transfers`` with the same transfer list, so all compute the same
rounds and sends match receives. Each (source, destination) pair's pieces travel as one flat
message and its CRC-32 (``zlib.crc32``, about 2.5 GB/s on one core), one ``batch_isend_irecv``
per round (``rounds_of``). Nothing here touches an engine, so a failure part-way leaves the old
state whole: the new engine is filled only after every message arrived and was checked.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

from meshmorph.elastic.live.local_state import HeldPiece, ReshapeError
from meshmorph.elastic.moves.box import Box
from meshmorph.elastic.moves.move_plan import Transfer

TENSOR_KINDS = ("param/", "exp_avg/", "exp_avg_sq/")
"""Keys whose pieces travel as tensors; the small state (step, LR schedule, data, RNG) travels
with the MovePlan's broadcast."""


def is_tensor_key(key: str) -> bool:
    return key.startswith(TENSOR_KINDS)


def rounds_of(transfers: Sequence[Transfer], staging_bytes: int) -> list[list[tuple[int, int]]]:
    """(src, dst) pairs per round: each device receives at most ``staging_bytes`` per round (a
    pair over the bound goes alone); pairs in sorted order, first fit. Elements are fp32."""
    per_pair: dict[tuple[int, int], int] = {}
    for t in transfers:
        if t.src_device != t.dst_device and is_tensor_key(t.key):
            pair = (t.src_device, t.dst_device)
            per_pair[pair] = per_pair.get(pair, 0) + t.box.numel * 4
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
    return zlib.crc32(tensor.detach().reshape(-1).cpu().contiguous().view(torch.uint8).numpy())


def _part(pieces: Mapping[str, list[HeldPiece]], key: str, box: Box) -> torch.Tensor:
    """The values of ``box`` of ``key`` from the held piece that contains it."""
    for piece in pieces.get(key, []):
        if Box(piece.offset, piece.shape).contains(box):
            local = box.slices_from(piece.offset)
            return piece.tensor[local] if local else piece.tensor
    raise ReshapeError(f"the move plan has this device send {key} {box}, but it holds "
                       f"{[str(Box(p.offset, p.shape)) for p in pieces.get(key, [])]}; the "
                       "Layout and the live engine disagree")


def execute_transfers(transfers: Iterable[Transfer], me: int,
                      held: Mapping[str, list[HeldPiece]], global_shapes: Mapping[str, tuple],
                      *, rank_of_device: Mapping[int, int], staging_bytes: int = 256 << 20,
                      verify: bool = True) -> list[HeldPiece]:
    """Run the tensor transfers of a move on device ``me``; returns the pieces it received (new
    fp32 tensors). ``held`` is what ``me`` holds now (by key), ``global_shapes`` the whole shape
    of every key, ``rank_of_device`` the rank of each device in the default group."""
    moves = [t for t in transfers if is_tensor_key(t.key) and t.src_device != t.dst_device]
    by_pair: dict[tuple[int, int], list[Transfer]] = {}
    for t in moves:
        by_pair.setdefault((t.src_device, t.dst_device), []).append(t)
    received: list[HeldPiece] = []
    for members in rounds_of(moves, staging_bytes):
        ops: list[dist.P2POp] = []
        inbox: list[tuple[list[Transfer], torch.Tensor, torch.Tensor]] = []
        for src, dst in members:
            if me not in (src, dst):
                continue
            batch = by_pair[(src, dst)]
            if me == src:
                parts = [_part(held, t.key, t.box).reshape(-1) for t in batch]
                flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.float32)
                sums = torch.tensor([crc32(flat) if verify else 0], dtype=torch.int64)
                ops += [dist.P2POp(dist.isend, flat, rank_of_device[dst]),
                        dist.P2POp(dist.isend, sums, rank_of_device[dst])]
            else:
                flat = torch.empty(sum(t.box.numel for t in batch), dtype=torch.float32)
                sums = torch.empty(1, dtype=torch.int64)
                ops += [dist.P2POp(dist.irecv, flat, rank_of_device[src]),
                        dist.P2POp(dist.irecv, sums, rank_of_device[src])]
                inbox.append((batch, flat, sums))
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
    return received
