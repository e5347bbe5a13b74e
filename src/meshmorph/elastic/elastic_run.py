"""The worker side of ``meshmorph run --elastic``: keep the state in the node-local store, and on a
(re)start under torchrun's elastic agent rebuild it for the world torch gave us.

- ``after_step``: every rank writes its pieces to the node store at each step boundary, and
  where the job spans more than one node, every K steps sends its file to the same local rank of
  the next node (``store.ring_copy``), so a lost node's pieces survive on its ring neighbour. K
  comes from the overhead budget (``store.ring_interval_steps``: the copy of a node's state over
  the cost model's inter-node link, spread over K measured step times, at most ``ring_budget``
  of them), agreed by every rank (the largest). ``MESHMORPH_LOCAL_NODE_SIZE=N`` treats each
  group of N consecutive ranks as a node (one machine standing in for several: tests, demos);
  otherwise a node is torchrun's ``GROUP_RANK``;
- ``restore``: a worker that finds state in the store (torchrun restarted the workers after a
  failure, or the membership changed) takes the newest step every old rank completed, re-plans
  when the world size changed (the planner; the global batch is kept, gradient accumulation
  absorbs a smaller dp), fills a new engine from the store and logs one reshape line and a
  ``{"event": "reshape"}`` record (``at_step``, not ``step``: metrics.jsonl's step lines are
  the ones with a ``step`` key);
- ``arm_failure``: ``--inject-failure RANK@STEP`` SIGKILLs that rank's worker in the forward of
  the step's second micro-batch (its first when there is one), once per run (a marker file in the
  run folder remembers it).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshmorph.elastic.choose_plan import choose_plan
from meshmorph.elastic.controller import replan
from meshmorph.elastic.layout import layout_of
from meshmorph.elastic.local_state import extract_state
from meshmorph.elastic.move_plan import plan_move
from meshmorph.elastic.move_time import predict_move_time_s
from meshmorph.elastic.restore_state import restore_from_store, restore_step
from meshmorph.elastic.store import NodeStore, ring_copy, ring_interval_steps
from meshmorph.spec.cluster import parse_cluster
from meshmorph.spec.plan import Plan


def parse_failure(text: str | None) -> tuple[int, int] | None:
    """``RANK@STEP`` -> (rank, step); None for None."""
    if text is None:
        return None
    rank, sep, step = text.partition("@")
    if not sep or not rank.isdigit() or not step.isdigit() or int(step) < 1:
        raise ValueError(f"--inject-failure takes RANK@STEP (e.g. 3@4, step >= 1), got {text!r}")
    return int(rank), int(step)


def parse_elastic(text: str) -> tuple[int, int]:
    """``MIN:MAX`` nodes (or one number) -> (min, max)."""
    low, _, high = text.partition(":")
    high = high or low
    if not low.isdigit() or not high.isdigit() or not 1 <= int(low) <= int(high):
        raise ValueError(f"--elastic takes MIN:MAX nodes with 1 <= MIN <= MAX, got {text!r}")
    return int(low), int(high)


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
    _last: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        local = os.environ.get("MESHMORPH_LOCAL_NODE_SIZE")
        if self.node_size is None and local:
            self.node_size = int(local)
        if self.node_size is not None:
            if self.node_size < 1:
                raise ValueError(f"MESHMORPH_LOCAL_NODE_SIZE must be >= 1, got {self.node_size}")
            node = int(os.environ.get("RANK", "0")) // self.node_size
        else:
            node = int(os.environ.get("GROUP_RANK", "0"))
        self.store = NodeStore(self.run_id, node)
        self._last = time.perf_counter()

    def ranks_per_node(self) -> int:
        return self.node_size or int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))

    def after_step(self, engine: Any, plan: Plan, step: int, consumed_samples: int) -> None:
        """Write this rank's state at the boundary after ``step`` (and its ring copy when due)."""
        state = extract_state(engine, consumed_samples=consumed_samples, checksums=False)
        self.store.save(dist.get_rank(), step, plan.to_json(), state)
        self._ring(step, state.nbytes)

    def _ring(self, step: int, state_bytes: int) -> None:
        world, size = dist.get_world_size(), self.ranks_per_node()
        nodes = world // size
        now, step_s = time.perf_counter(), time.perf_counter() - self._last
        self._last = now
        if nodes < 2 or world % size:
            return
        if self.ring_every is None:  # K from the budget, the same on every rank (the largest)
            from meshmorph.cost import comm
            from meshmorph.cost.coefficients import CostCoefficients

            link = comm.Link.from_spec(parse_cluster(f"cpu:{nodes}x{size}").inter_link,
                                       CostCoefficients().link_efficiency)
            k = ring_interval_steps(state_bytes * size, link.bandwidth_bps, max(step_s, 1e-6),
                                    self.ring_budget)
            agreed = torch.tensor([k], dtype=torch.int64)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            self.ring_every = int(agreed[0])
        if step % self.ring_every:
            return
        rank = dist.get_rank()
        ring_copy(self.store, rank, step, {"next": (rank + size) % world,
                                           "prev": (rank - size) % world})
        self.ring_copies += 1

    def arm_failure(self, engine: Any, step: int) -> None:
        """SIGKILL this worker during ``step`` if it is the injected failure (once per run)."""
        if self.failure is None or self.failure != (dist.get_rank(), step):
            return
        marker = self.out_dir / f".failure-injected-{self.failure[0]}-{self.failure[1]}"
        if marker.exists():
            return
        marker.write_text(str(os.getpid()))
        calls = {"n": 0}
        kill_at = 2 if engine.plan.num_microbatches > 1 else 1

        def hook(module: Any, args: Any) -> None:
            calls["n"] += 1
            if calls["n"] == kill_at:
                print(f"meshmorph: injected failure: SIGKILL rank {dist.get_rank()} (pid "
                      f"{os.getpid()}) in step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

        engine.model_parts[0].register_forward_pre_hook(hook)

    def restore(self, model: Any, optim: Any, *, seed: int, device: torch.device,
                total_steps: int | None = None
                ) -> tuple[Any, Plan, int, int, dict[str, Any]] | None:
        """(engine, plan, step, consumed samples, reshape record) from the store; None when it
        holds nothing of this run (a fresh start). When the world size changed, the new plan is
        the one with the least predicted time to finish, its move included (``choose_plan``,
        over the ``total_steps`` left; without them, the planner's fastest)."""
        from meshmorph.run.engine import build_engine

        stored = self.store.steps()
        if not stored:
            return None
        start = time.perf_counter()
        rank, world = dist.get_rank(), dist.get_world_size()
        first = self.store.load(min(stored), max(stored[min(stored)]))
        plan_a = Plan.from_json(first.plan_json)
        step = restore_step(self.store, list(range(plan_a.world_size)))
        if step is None:
            raise ValueError(f"the node store {self.store.dir} holds no step every rank of the "
                             f"old plan completed ({stored}); resume from the newest checkpoint "
                             "(meshmorph run --resume --reshard)")
        survivors = list(range(min(world, plan_a.world_size)))
        if plan_a.world_size == world:
            plan_b = plan_a
        elif total_steps is not None:
            plan_b = choose_plan(model, plan_a, world, survivors=survivors,
                                 steps_left=max(total_steps - step, 0)).plan
        else:
            plan_b = replan(model, world, global_batch=plan_a.global_batch, dtype=plan_a.dtype)
        engine = build_engine(model, plan_b, optim, seed=seed, device=device)
        report = restore_from_store(self.store, new_rank=rank,
                                    old_rank=rank if rank < plan_a.world_size else None,
                                    step=step, model=model, plan_b=plan_b, engine=engine)
        dist.barrier()
        move = plan_move(layout_of(model, plan_a), layout_of(model, plan_b), survivors)
        record = {"event": "reshape", "at_step": step, "from": plan_a.to_dict(),
                  "to": plan_b.to_dict(), "bytes_moved": move.bytes_moved,
                  "lower_bound_bytes": move.lower_bound_bytes, "naive_bytes": move.naive_bytes,
                  "busiest_device_bytes": move.busiest_device_bytes,
                  "predicted_time_s": predict_move_time_s(
                      move, parse_cluster(f"cpu:1x{len(move.devices)}")),
                  "measured_time_s": time.perf_counter() - start,
                  "sources": report.bytes_from, "consumed_samples": report.consumed_samples}
        if rank == 0:
            print(f"meshmorph: reshape at step {step}: {_plan_line(plan_a)} -> {_plan_line(plan_b)}"
                  f"; {move.bytes_moved / 1e6:.2f} MB between devices (lower bound "
                  f"{move.lower_bound_bytes / 1e6:.2f}, rank order {move.naive_bytes / 1e6:.2f})"
                  f", {record['measured_time_s']:.2f} s; rank 0's pieces from "
                  + ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in report.bytes_from.items()),
                  flush=True)
        return engine, plan_b, step, report.consumed_samples, record
