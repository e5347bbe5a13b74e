"""The worker side of ``meshmorph run --elastic``: keep the state in the node-local store, and on a
(re)start under torchrun's elastic agent rebuild it for the world torch gave us.

- ``after_step``: every rank writes its pieces to the node store at each step boundary;
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
from meshmorph.elastic.store import NodeStore
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
    store: NodeStore = field(init=False)
    """This node's store (node = torchrun's ``GROUP_RANK``)."""

    def __post_init__(self) -> None:
        self.store = NodeStore(self.run_id, int(os.environ.get("GROUP_RANK", "0")))

    def after_step(self, engine: Any, plan: Plan, step: int, consumed_samples: int) -> None:
        """Write this rank's state at the boundary after ``step``."""
        state = extract_state(engine, consumed_samples=consumed_samples, checksums=False)
        self.store.save(dist.get_rank(), step, plan.to_json(), state)

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
