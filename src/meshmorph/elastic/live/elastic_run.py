"""The worker side of ``meshmorph run --elastic``: keep the state in the node-local store, and on a
(re)start under torchrun's elastic agent rebuild it for the world torch gave us.

Across nodes, every K steps each rank also sends its file to the same local rank of the next
node (``store.ring_copy``), so a lost node's pieces survive on its neighbour; K keeps the copy
within ``ring_budget`` of the step time (``store.ring_interval_steps``), the largest over the
ranks. A node is torchrun's ``GROUP_RANK``, or each N consecutive ranks under
``MESHMORPH_LOCAL_NODE_SIZE=N`` (tests, demos).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshmorph.cost import comm
from meshmorph.cost.coefficients import CostCoefficients
from meshmorph.elastic.live.controller import replan
from meshmorph.elastic.live.local_state import extract_state
from meshmorph.elastic.live.restore_state import old_ranks_read, restore_from_store
from meshmorph.elastic.live.store import NodeStore, ring_copy, ring_interval_steps
from meshmorph.elastic.live.store_pull import (
    Inventory,
    claim_old_ranks,
    common_step,
    gather_inventories,
    pull_files,
)
from meshmorph.elastic.moves.choose_plan import choose_plan
from meshmorph.elastic.moves.layout import layout_of
from meshmorph.elastic.moves.move_plan import plan_move
from meshmorph.elastic.moves.move_time import cpu_cluster, predict_move_time_s
from meshmorph.run import fault
from meshmorph.run.engine.train_engine import build_engine
from meshmorph.run.fault import Fault
from meshmorph.run.launch.console import recovered_line
from meshmorph.run.model.materialize import state_installed_after
from meshmorph.spec.cluster import parse_cluster
from meshmorph.spec.plan import Plan

NODE_ID_ENV = "MESHMORPH_NODE_ID"
"""This node's number (``meshmorph run --node-rank``): it names the node's store, which outlives
the node's workers whatever group ranks torchrun's rendezvous hands out next."""


def _plan_line(plan: Plan) -> str:
    return f"tp {plan.tp} x pp {plan.pp} x dp {plan.dp} (zero {plan.zero}, {plan.world_size} ranks)"


@dataclass(slots=True)
class ElasticSession:
    """One worker's link to its node store for the run."""

    run_id: str
    """Names the store (``/dev/shm/meshmorph-<run_id>``)."""
    out_dir: Path
    """The run folder (the failure marker lives there)."""
    failure: tuple[int, int] | None = None
    """(rank, step) to SIGKILL once, for tests and demos."""
    ring_budget: float = 0.02
    """Most fraction of the step time the ring copy may cost on average (it sets K)."""
    node_size: int | None = None
    """Ranks per node (None: ``MESHMORPH_LOCAL_NODE_SIZE`` if set, else torchrun's
    ``LOCAL_WORLD_SIZE``, nodes being ``GROUP_RANK``)."""
    ring_every: int | None = None
    """K, steps between ring copies (None: chosen at the first step boundary)."""
    ring_copies: int = 0
    """Ring copies this rank took part in."""
    store: NodeStore = field(init=False)
    """This node's store."""
    local: int = field(init=False, default=0)
    """This worker's index among its node's workers."""
    _last: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        local = os.environ.get("MESHMORPH_LOCAL_NODE_SIZE")
        if self.node_size is None and local:
            self.node_size = int(local)
        named = os.environ.get(NODE_ID_ENV)
        if named is not None:  # a node of its own (meshmorph run --node-rank)
            if not named.isdigit():
                raise ValueError(f"{NODE_ID_ENV} must be a node number (0, 1, ...), got {named!r}")
            node, self.local = int(named), int(os.environ.get("LOCAL_RANK", "0"))
        elif self.node_size is not None:
            if self.node_size < 1:
                raise ValueError(f"MESHMORPH_LOCAL_NODE_SIZE must be >= 1, got {self.node_size}")
            rank = int(os.environ.get("RANK", "0"))
            node, self.local = rank // self.node_size, rank % self.node_size
        else:
            node = int(os.environ.get("GROUP_RANK", "0"))
            self.local = int(os.environ.get("LOCAL_RANK", "0"))
        self.store = NodeStore(self.run_id, node)
        self._last = time.perf_counter()

    def ranks_per_node(self) -> int:
        return self.node_size or int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))

    def after_step(self, engine: Any, plan: Plan, step: int, consumed_samples: int) -> None:
        """Write this rank's state at the boundary after ``step`` (and its ring copy when due)."""
        state = extract_state(engine, consumed_samples=consumed_samples)
        self.store.save(dist.get_rank(), step, plan.to_json(), state)
        self._ring(step, state.nbytes)

    def _ring(self, step: int, state_bytes: int, *, now_due: bool = False) -> None:
        """The ring copy of ``step`` when it is due (every K steps; ``now_due``: at once)."""
        world, size = dist.get_world_size(), self.ranks_per_node()
        nodes = world // size
        now, step_s = time.perf_counter(), time.perf_counter() - self._last
        self._last = now
        if nodes < 2 or world % size:
            return
        if self.ring_every is None:  # K from the budget, the same on every rank (the largest)
            link = comm.Link.from_spec(parse_cluster(f"cpu:{nodes}x{size}").inter_link,
                                       CostCoefficients().link_efficiency)
            k = ring_interval_steps(state_bytes * size, link.bandwidth_bps, max(step_s, 1e-6),
                                    self.ring_budget)
            agreed = torch.tensor([k], dtype=torch.int64)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            self.ring_every = int(agreed[0])
        if step % self.ring_every and not now_due:
            return
        rank = dist.get_rank()
        ring_copy(self.store, rank, step, {"next": (rank + size) % world,
                                           "prev": (rank - size) % world})
        self.store.pinned = {step}  # a lost node comes back at this step: keep ours of it too
        self.ring_copies += 1

    def injected(self) -> list[Fault]:
        """``--inject-failure RANK@STEP`` as the fault it is: SIGKILL in the forward of that
        step (``run/fault.py``, once per run)."""
        if self.failure is None:
            return []
        rank, step = self.failure
        return [Fault(rank, step, "forward", marker_name=f".failure-injected-{rank}-{step}")]

    def restore(self, model: Any, optim: Any, *, seed: int, device: torch.device,
                total_steps: int | None = None
                ) -> tuple[Any, Plan, int, int, dict[str, Any]] | None:
        """(engine, plan, step, consumed samples, ``{"event": "reshape"}`` record) from the node
        stores; None when no node holds anything of this run (a fresh start). Collective over
        the default group. The workers agree on the newest step every old rank is stored at on
        some node; each takes up an old rank (``store_pull.claim_old_ranks``) and pulls the
        files its node lacks (``store_pull.pull_files``). Where the world size changed, the new
        plan has the least predicted time to finish over the ``total_steps`` left
        (``choose_plan``; without them, the planner's fastest). The store then holds the new
        plan's state at that step alone. Prints one ``recovered at step ...`` line per node on
        stderr (the launcher's cue) and one reshape line; the record's ``at_step`` is not
        ``step``, the key of metrics.jsonl's step lines."""
        inventories = gather_inventories(self.store, self.local)
        if all(inv.empty for inv in inventories):
            return None
        start = time.perf_counter()
        rank, world = dist.get_rank(), dist.get_world_size()
        plan_a, step = self._agree_step(inventories)
        claims = claim_old_ranks(inventories, step, plan_a.world_size)
        survivors = sorted({r for inv in inventories for r, s in inv.own.items()
                            if step in s and r < plan_a.world_size})
        if plan_a.world_size == world:
            plan_b = plan_a
        elif total_steps is not None:
            plan_b = choose_plan(model, plan_a, world, survivors=survivors,
                                 steps_left=max(total_steps - step, 0)).plan
        else:
            plan_b = replan(model, world, global_batch=plan_a.global_batch, dtype=plan_a.dtype)
        mine = inventories[rank]
        local = {r for r in range(plan_a.world_size) if mine.has(r, step)}
        old_rank = claims.get(rank)
        wanted = [r for r in old_ranks_read(model, plan_a, plan_b, new_rank=rank,
                                            old_rank=old_rank, local=local) if r not in local]
        pulled = pull_files(self.store, inventories, step, wanted)
        fault.point("reshape", step)  # MESHMORPH_FAULT (tests): mid-transfer
        with state_installed_after():  # every value is written by restore_from_store
            engine = build_engine(model, plan_b, optim, seed=seed, device=device)
        report = restore_from_store(self.store, new_rank=rank, old_rank=old_rank, step=step,
                                    model=model, plan_b=plan_b, engine=engine, plan_a=plan_a,
                                    pulled=pulled, local_ranks=local)
        dist.barrier()
        self._reseed(engine, plan_b, step, report.consumed_samples, inventories)
        move = plan_move(layout_of(model, plan_a), layout_of(model, plan_b), survivors)
        sources: list[Any] = [None] * world
        dist.all_gather_object(sources, report.bytes_from)
        by_source: dict[str, int] = {}
        for each in sources:
            for name, nbytes in (each or {}).items():
                by_source[name] = by_source.get(name, 0) + nbytes
        record = {"event": "reshape", "at_step": step, "from": plan_a.to_dict(),
                  "to": plan_b.to_dict(), "bytes_moved": move.bytes_moved,
                  "lower_bound_bytes": move.lower_bound_bytes, "naive_bytes": move.naive_bytes,
                  "busiest_device_bytes": move.busiest_device_bytes,
                  "predicted_time_s": predict_move_time_s(move, cpu_cluster(move)),
                  "measured_time_s": time.perf_counter() - start,
                  "sources": report.bytes_from, "sources_all_ranks": by_source,
                  "survivors": survivors, "lost": sorted(set(range(plan_a.world_size))
                                                         - set(survivors)),
                  "consumed_samples": report.consumed_samples}
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # one per agent: its launcher's cue
            print(recovered_line(step, world, plan_a.world_size, sorted(by_source)),
                  file=sys.stderr, flush=True)
        if rank == 0:  # on stderr too, so that it follows the line above on the console
            print(f"meshmorph: reshape at step {step}: {_plan_line(plan_a)} -> {_plan_line(plan_b)}"
                  f"; {move.bytes_moved / 1e6:.2f} MB between devices (lower bound "
                  f"{move.lower_bound_bytes / 1e6:.2f}, rank order {move.naive_bytes / 1e6:.2f})"
                  f", {record['measured_time_s']:.2f} s; pieces from "
                  + ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in sorted(by_source.items())),
                  file=sys.stderr, flush=True)
        return engine, plan_b, step, report.consumed_samples, record

    def _agree_step(self, inventories: list[Inventory]) -> tuple[Plan, int]:
        """Plan A (from the newest file of the lowest worker holding one) and the newest step
        every one of its ranks is stored at on some node, broadcast from that worker."""
        root = next(inv.rank for inv in inventories if not inv.empty)
        box: list[Any] = [None]
        if dist.get_rank() == root:
            mine = inventories[root]
            newest = max(((s, r, "node") for r, steps in mine.own.items() for s in steps),
                         default=None) or max((s, r, "ring") for r, steps in mine.ring.items()
                                              for s in steps)
            folder = self.store.dir if newest[2] == "node" else self.store.replicas
            plan_json = self.store.load(newest[1], newest[0], folder).plan_json
            box = [(plan_json, common_step(inventories, Plan.from_json(plan_json).world_size))]
        dist.broadcast_object_list(box, src=root)
        plan_json, step = box[0]
        if step is None:
            held = {inv.node: (inv.own, inv.ring) for inv in inventories}
            raise ValueError(f"no step is stored for every rank of the old plan on the live nodes "
                             f"(node -> (own, ring copy) steps: {held}); resume from the newest "
                             "checkpoint (meshmorph run --resume --reshard)")
        return Plan.from_json(plan_json), step

    def _reseed(self, engine: Any, plan: Plan, step: int, consumed: int,
                inventories: list[Inventory]) -> None:
        """Write the restored state at ``step`` under the new plan and drop every older file of
        this node (the old plan's, the ring copy), so the store never mixes two plans; then,
        with several nodes, the ring copy of ``step`` at once."""
        state = extract_state(engine, consumed_samples=consumed)
        self.store.save(dist.get_rank(), step, plan.to_json(), state)
        dist.barrier()
        if self.local == 0:
            self.store.keep_only({inv.rank for inv in inventories
                                  if inv.node == self.store.node}, step)
        dist.barrier()
        # the ring copies went with the old files: copy the restored step now, or a node lost
        # before the next ring step could not be rebuilt from memory
        self._ring(step, state.nbytes, now_due=True)
