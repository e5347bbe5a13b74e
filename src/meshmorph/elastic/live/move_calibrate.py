"""Measure the coefficients of a move's predicted time on the processes that will move, once.

Collective over the default process group, a second or two on 4 CPU processes. Every figure is
a primitive measured on its own, never a move or an engine build, and the slowest process sets
it:

- ``p2p_alpha_s``, ``p2p_beta_s_per_byte``: the line through one pair (ranks 0 and 1)
  exchanging messages both ways with one ``batch_isend_irecv`` into fresh buffers, as the move
  does, at ``SIZES``, the other processes idle; ``host_streams``: every pair at once against
  the lone pair, ``2 * pairs * t_alone / t_all`` (an exchange is two messages);
- ``checksum_bps``: packing (``torch.cat``) and CRC-32; ``copy_bps``: copying into a tensor
  already written once (a parameter's shard); ``fresh_copy_bps``: into new tensors;
  ``zero_bps``: allocating and zeroing them;
- ``group_s``, ``group_call_s``, ``mesh_group_s``: process groups (``_group_times``,
  ``_regroup_s``); ``agree_s``, ``agree_s_per_byte``, ``fixed_s``: the MovePlan's broadcast and
  a barrier (``_agree_times``);
- the per-tensor build, read and install costs: ``probe.probe_costs``.
"""

from __future__ import annotations

import pickle
import statistics
import time
import zlib
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from meshmorph.elastic.live.controller import regroup
from meshmorph.elastic.live.probe import probe_costs, timed
from meshmorph.elastic.moves.box import Box
from meshmorph.elastic.moves.move_plan import Transfer
from meshmorph.elastic.moves.move_time import MoveTimeModel
from meshmorph.profile.alpha_beta import fit_alpha_beta
from meshmorph.spec.model import ModelSpec

SIZES = (1 << 20, 4 << 20, 16 << 20)
"""Message sizes the exchange is timed at (bytes)."""
PROBE_REPEATS = 5
"""Probes of the per-tensor costs (median; each is tens of milliseconds)."""
FRESH_PIECE_BYTES = 1 << 20
"""Size of the new tensors the fresh-memory rates write (a decoder's weights are 0.1-4 MB)."""
AGREE_ITEMS = 1000
"""Transfers in the object broadcast that stands for a MovePlan (a 4-process GPT's has 1000s)."""


def _exchange_s(nbytes: int, active: Sequence[int], repeats: int) -> float:
    """Median seconds of a two-way exchange of ``nbytes`` between ranks 2i and 2i + 1 of
    ``active`` pairs (all at once); every rank returns the same figure (rank 0's)."""
    rank = dist.get_rank()
    pair, side = divmod(rank, 2)
    peer = rank + 1 if side == 0 else rank - 1
    out = torch.empty(nbytes // 4)
    times, kept = [], []
    for _ in range(repeats):
        inbox = torch.empty_like(out)  # kept below: untouched pages, as the move's receive into
        kept.append(inbox)
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


def _fresh(t: torch.Tensor, fill: Callable[[torch.Tensor, torch.Tensor], object]
           ) -> list[torch.Tensor]:
    """``t``'s bytes written into new tensors of ``FRESH_PIECE_BYTES``, all kept alive until the
    end (as an engine's shards and moments are), so each is memory the process has not touched
    yet rather than the allocator's last free block."""
    pieces = []
    step = FRESH_PIECE_BYTES // t.element_size()
    for start in range(0, t.numel(), step):
        src = t[start:start + step]
        piece = torch.empty_like(src)
        fill(piece, src)
        pieces.append(piece)
    return pieces


def _rate_bps(fn: Callable[[], object], nbytes: int, repeats: int = 3) -> float:
    return nbytes / max(statistics.median(timed(fn) for _ in range(repeats)), 1e-9)


def _group_times(world: int, repeats: int) -> tuple[float, float, float]:
    """(whole-world group, one size-1 mesh call, one size-2 mesh group beyond its calls):
    median seconds, this process's view."""
    whole, ones, pairs = [], [], []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        group = dist.new_group(list(range(world)))
        dist.barrier(group=group)
        whole.append(time.perf_counter() - start)
        dist.destroy_process_group(group)
        dist.barrier()
        start = time.perf_counter()
        singles = [dist.new_group([r]) for r in range(world)]
        ones.append((time.perf_counter() - start) / world)
        dist.barrier()
        start = time.perf_counter()
        twos = [dist.new_group([2 * i, 2 * i + 1]) for i in range(world // 2)]
        dist.barrier()
        pairs.append(time.perf_counter() - start)
        for group in [*singles, *twos]:
            if group != dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(group)
    call = statistics.median(ones)
    return (statistics.median(whole), call,
            max(statistics.median(pairs) - (world // 2) * call, 0.0))


def _agree_times(repeats: int) -> tuple[float, float, float]:
    """(broadcast at zero bytes, per pickled byte, one barrier) from broadcasting lists of
    ``AGREE_ITEMS`` and 4 x ``AGREE_ITEMS`` MovePlan transfers from rank 0 (pickled, sent and
    unpickled as the MovePlan is)."""
    sizes, times = [], []
    for items in (AGREE_ITEMS, 4 * AGREE_ITEMS):
        obj = [Transfer(i % 4, (i + 1) % 4, f"exp_avg/blocks.{i}.attn.wq.weight",
                        Box((i, 0), (8, 512)), 8 * 512 * 4) for i in range(items)]
        sizes.append(len(pickle.dumps(obj)))
        laps = []
        for _ in range(repeats):
            payload: list[object] = [obj if dist.get_rank() == 0 else None]
            dist.barrier()
            laps.append(timed(partial(dist.broadcast_object_list, payload, src=0)))
        times.append(statistics.median(laps))
    per_byte = max((times[1] - times[0]) / (sizes[1] - sizes[0]), 0.0)
    barrier = statistics.median(timed(dist.barrier) for _ in range(repeats))
    return max(times[0] - sizes[0] * per_byte, 0.0), per_byte, barrier


def _regroup_s(store_dir: Path, tag: str, repeats: int) -> float:
    """Median seconds of re-forming the default group over the same processes in the same
    order the way a move forms its groups (``controller.regroup``: leave the group, a FileStore,
    ``init_process_group``, a barrier)."""
    me, members = dist.get_rank(), list(range(dist.get_world_size()))
    times = []
    for i in range(repeats):
        dist.barrier()
        times.append(timed(partial(regroup, store_dir, f"{tag}-{i}", me, members)))
    return statistics.median(times)


def calibrate_move_time(*, model: ModelSpec, repeats: int = 3, store_dir: Path | None = None,
                        tag: str = "calibrate") -> MoveTimeModel:
    """Measured ``MoveTimeModel`` of this process group (collective; needs 2 processes or more,
    an even number for the pair groups); ``model``: the job's model, whose decoder block the
    per-tensor costs are measured on; ``store_dir``: where the move's FileStores go: given,
    ``group_s`` is measured by re-forming the default group as a move does (``tag`` names its
    stores; every subgroup the caller held is gone after), else by ``new_group`` over the
    running one."""
    world = dist.get_world_size()
    if world < 2:
        raise ValueError("calibrating a move needs 2 processes at least (a point-to-point pair)")
    pairs = world // 2
    lone = [_exchange_s(n, [0], repeats) for n in SIZES]
    alone = fit_alpha_beta(SIZES, lone)
    together = _exchange_s(SIZES[-1], range(pairs), repeats)
    # the largest exchange's times (alpha is a few ms of them), not two fitted slopes: the ratio
    # of two slopes through three noisy points each strays far on a loaded host
    streams = 2 * pairs * lone[-1] / together
    nbytes = SIZES[-1]
    t = torch.randn(nbytes // 4)
    halves = [t[: t.numel() // 2], t[t.numel() // 2:]]
    sink = torch.empty_like(t).zero_()
    checksum = _rate_bps(lambda: zlib.crc32(torch.cat(halves).view(torch.uint8).numpy()), nbytes)
    copy = _rate_bps(lambda: sink.copy_(t), nbytes)
    fresh = _rate_bps(lambda: _fresh(t, lambda piece, src: piece.copy_(src)), nbytes)
    zero = _rate_bps(lambda: _fresh(t, lambda piece, _: piece.zero_()), nbytes)
    whole, call, pair = _group_times(world, max(repeats - 1, 1))
    if store_dir is not None:
        whole = _regroup_s(store_dir, tag, max(repeats - 1, 1))
    agree, per_byte, barrier = _agree_times(repeats)
    rates = {"checksum_bps": checksum, "copy_bps": copy, "fresh_copy_bps": fresh, "zero_bps": zero}
    seconds = {"group_s": whole, "group_call_s": call, "mesh_group_s": pair, "agree_s": agree,
               "agree_s_per_byte": per_byte, "fixed_s": barrier,
               **probe_costs(model, zero_bps=zero, repeats=PROBE_REPEATS)}
    gathered: list[tuple[dict[str, float], dict[str, float]]] = [({}, {})] * world
    dist.all_gather_object(gathered, (rates, seconds))  # the slowest process sets each figure
    return MoveTimeModel(
        p2p_alpha_s=alone.alpha_s, p2p_beta_s_per_byte=alone.beta_s_per_byte,
        host_streams=max(streams, 1.0),
        **{name: min(g[0][name] for g in gathered) for name in rates},
        **{name: max(g[1][name] for g in gathered) for name in seconds})
