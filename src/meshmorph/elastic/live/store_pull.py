"""What every node's store holds, agreed by all workers, and stored files pulled between nodes.

After a restart each worker sees only its own node's store; the inventories let all agree on
the step to restore and on who takes up which old rank. A file a worker's node lacks comes
point to point from a worker of a node that holds it (``pull_files``), never from another
node's folder.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshmorph.elastic.live.local_state import ReshapeError
from meshmorph.elastic.live.store import NodeStore, StoredState, from_bytes, newest_common


@dataclass(frozen=True, slots=True)
class Inventory:
    """What one worker's node store holds."""

    rank: int
    """The worker's rank in the restarted group."""
    node: int
    """Its node (``NodeStore.node``)."""
    local: int
    """Its index among its node's workers."""
    own: dict[int, list[int]]
    """Old rank -> steps stored in the node's own folder (ranks this node ran)."""
    ring: dict[int, list[int]]
    """Old rank -> steps in the node's ring copy (another node's ranks)."""

    def has(self, old_rank: int, step: int) -> str | None:
        """``node`` or ``ring`` where this node holds ``old_rank`` at ``step``; None: it does not."""
        if step in self.own.get(old_rank, []):
            return "node"
        if step in self.ring.get(old_rank, []):
            return "ring"
        return None

    @property
    def empty(self) -> bool:
        return not self.own and not self.ring


def gather_inventories(store: NodeStore, local: int) -> list[Inventory]:
    """Every worker's inventory, in rank order (collective over the default group)."""
    mine = Inventory(dist.get_rank(), store.node, local, store.steps(), store.steps(store.replicas))
    every: list[Inventory | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return [inv for inv in every if inv is not None]


def common_step(inventories: list[Inventory], world_a: int) -> int | None:
    """The newest step at which every old rank ``0..world_a-1`` is stored on some node."""
    return newest_common(range(world_a), *(held for inv in inventories
                                           for held in (inv.own, inv.ring)))


def claim_old_ranks(inventories: list[Inventory], step: int, world_a: int) -> dict[int, int]:
    """Worker rank -> the old rank it takes up (its node's own files by local rank; a lost node's
    ranks to workers without one, in rank order). Workers left over take up none."""
    claims: dict[int, int] = {}
    for inv in inventories:
        mine = sorted(r for r, steps in inv.own.items() if step in steps and r < world_a)
        if inv.local < len(mine):
            claims[inv.rank] = mine[inv.local]
    orphans = iter(sorted(set(range(world_a)) - set(claims.values())))
    for inv in inventories:
        if inv.rank not in claims:
            old = next(orphans, None)
            if old is None:
                break
            claims[inv.rank] = old
    return claims


def pull_files(store: NodeStore, inventories: list[Inventory], step: int, wanted: list[int]
               ) -> dict[int, tuple[StoredState, str]]:
    """Old rank -> (its stored state at ``step``, ``net-node`` or ``net-ring``) for each rank in
    ``wanted`` (this worker's), sent by the lowest worker of a node that holds it. Collective
    over the default group: every worker calls it, with what it wants (maybe nothing)."""
    requests: list[list[int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(requests, sorted(wanted))
    me = dist.get_rank()
    pulled: dict[int, tuple[StoredState, str]] = {}
    for requester, olds in enumerate(requests):
        for old in olds or []:
            holders = [(inv.rank, inv.has(old, step)) for inv in inventories
                       if inv.has(old, step) and inv.node != inventories[requester].node]
            if not holders:
                raise ReshapeError(f"no live node holds old rank {old}'s state at step {step} "
                                   "(its node and ring copy are gone); restart from the newest "
                                   "checkpoint (meshmorph run --resume --reshard)")
            sender, where = holders[0]
            if me == sender:
                folder = store.dir if where == "node" else store.replicas
                data = store.path(old, step, folder).read_bytes()
                head = torch.tensor([len(data), zlib.crc32(data)], dtype=torch.int64)
                dist.send(head, requester)
                dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), requester)
            elif me == requester:
                head = torch.empty(2, dtype=torch.int64)
                dist.recv(head, sender)
                body = torch.empty(int(head[0]), dtype=torch.uint8)
                dist.recv(body, sender)
                data = body.numpy().tobytes()
                if zlib.crc32(data) != int(head[1]):
                    raise ReshapeError(f"old rank {old}'s state pulled from rank {sender} failed "
                                       "its CRC-32 check; restart the job to try again")
                pulled[old] = (from_bytes(data), f"net-{where}")
    return pulled
