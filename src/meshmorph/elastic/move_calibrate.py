"""Measure the coefficients of a move's predicted time on the processes that will move, once.

Collective over the default process group (every process calls it), about a second on 4 CPU
processes. What each ``MoveTimeModel`` field comes from:

- ``p2p_alpha_s``, ``p2p_beta_s_per_byte``: the least-squares line (``profile.alpha_beta``)
  through the median times of one pair (ranks 0 and 1) exchanging messages both ways with one
  ``batch_isend_irecv`` into freshly allocated buffers, as the move does, at several sizes,
  every other process idle;
- ``host_streams``: the same exchange run by every pair at once (ranks 2i and 2i + 1); its slope
  against the lone pair's says how many messages the host carries at full speed together:
  ``2 * pairs * beta_alone / beta_all`` (each exchange is two messages);
- ``checksum_bps``: one process packing (``torch.cat``) and CRC-32-ing a message;
- ``copy_bps``: one process copying a message into another tensor (the install);
- ``group_s``: forming one process group over every process (``dist.new_group``);
- ``fixed_s`` (unless given): agreeing on a MovePlan-sized object (``broadcast_object_list`` of
  ``AGREE_ITEMS`` transfers from rank 0) and the barrier that ends the move;
- ``build_s``: given by the caller (the measured build of the engine that runs now).
"""

from __future__ import annotations

import statistics
import time
import zlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from meshmorph.elastic.move_time import MoveTimeModel
from meshmorph.profile.alpha_beta import fit_alpha_beta

SIZES = (1 << 20, 4 << 20, 16 << 20)
"""Message sizes the exchange is timed at (bytes)."""
AGREE_ITEMS = 1000
"""Transfers in the object broadcast that stands for a MovePlan (a 4-process GPT's has 1000s)."""


def _exchange_s(nbytes: int, active: Sequence[int], repeats: int) -> float:
    """Median seconds of a two-way exchange of ``nbytes`` between ranks 2i and 2i + 1 of
    ``active`` pairs (all at once); every rank returns the same figure (rank 0's)."""
    rank = dist.get_rank()
    pair, side = divmod(rank, 2)
    peer = rank + 1 if side == 0 else rank - 1
    out = torch.empty(nbytes // 4)
    times = []
    for _ in range(repeats):
        inbox = torch.empty_like(out)  # fresh pages, as the move's receive buffers are
        dist.barrier()
        start = time.perf_counter()
        if pair in active and peer < dist.get_world_size():
            ops = [dist.P2POp(dist.isend, out, peer), dist.P2POp(dist.irecv, inbox, peer)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        dist.barrier()
        times.append(time.perf_counter() - start)
    box = [statistics.median(times)]
    dist.broadcast_object_list(box, src=0)
    return float(box[0])


def _rate_bps(fn: object, nbytes: int, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return nbytes / max(statistics.median(times), 1e-9)


def calibrate_move_time(*, build_s: float = 0.0, repeats: int = 3,
                        fixed_s: float | None = None) -> MoveTimeModel:
    """Measured ``MoveTimeModel`` of this process group (collective; needs 2 processes or more);
    ``build_s``: the measured seconds of building the running engine; ``fixed_s``: the
    agreement and barrier (None: measured)."""
    world = dist.get_world_size()
    if world < 2:
        raise ValueError("calibrating a move needs 2 processes at least (a point-to-point pair)")
    pairs = world // 2
    alone = fit_alpha_beta(SIZES, [_exchange_s(n, [0], repeats) for n in SIZES])
    together = fit_alpha_beta(SIZES, [_exchange_s(n, range(pairs), repeats) for n in SIZES])
    streams = 2 * pairs * alone.beta_s_per_byte / together.beta_s_per_byte
    nbytes = SIZES[-1]
    t = torch.randn(nbytes // 4)
    halves = [t[: t.numel() // 2], t[t.numel() // 2:]]
    sink = torch.empty_like(t)
    checksum = _rate_bps(lambda: zlib.crc32(torch.cat(halves).view(torch.uint8).numpy()), nbytes)
    copy = _rate_bps(lambda: sink.copy_(t), nbytes)
    group_times = []
    for _ in range(2):
        dist.barrier()
        start = time.perf_counter()
        group = dist.new_group(list(range(world)))
        dist.barrier(group=group)
        group_times.append(time.perf_counter() - start)
        dist.destroy_process_group(group)
    agree_times = []
    for _ in range(repeats):
        payload: list[object] = [[(i, "exp_avg/blocks.0.attn.qkv.weight", (i, 0), (8, 512))
                                  for i in range(AGREE_ITEMS)] if dist.get_rank() == 0 else None]
        dist.barrier()
        start = time.perf_counter()
        dist.broadcast_object_list(payload, src=0)
        dist.barrier()
        agree_times.append(time.perf_counter() - start)
    local = [checksum, copy, statistics.median(group_times), statistics.median(agree_times)]
    gathered: list[list[float]] = [[] for _ in range(world)]
    dist.all_gather_object(gathered, local)  # the slowest process sets each figure
    return MoveTimeModel(
        fixed_s=max(g[3] for g in gathered) if fixed_s is None else fixed_s, p2p_alpha_s=alone.alpha_s, p2p_beta_s_per_byte=alone.beta_s_per_byte,
        host_streams=max(streams, 1.0), checksum_bps=min(g[0] for g in gathered),
        copy_bps=min(g[1] for g in gathered), group_s=max(g[2] for g in gathered),
        build_s=build_s)
