"""Reshape a running job in memory: from an engine of Plan A on some processes to an engine of
Plan B on others, moving only what the MovePlan says. Every process that takes part calls
``reshape_in_memory`` with the same arguments (its own ``me`` and engine aside):

1. its pieces out of its old engine (views, ``local_state.extract_state``);
2. one process group over every process that sends or receives (the default group where it
   already spans Plan A's processes in rank order and nobody joins, else ``regroup``);
3. the first survivor plans the move (pure; a planned leave places Plan B's ranks on the
   processes that stay) and broadcasts it with the small state; the transfers
   (``execute.execute_transfers``) and a barrier;
4. Plan B's process group (the move's again where its ranks are already in placement order),
   the new engine built on meta and filled from the pieces kept and received
   (``local_state.install_state``).

The old engine is only read until step 4: a failure before it leaves its state whole. Process
groups are formed over a ``FileStore`` in ``store_dir``, one file per step of the move.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshmorph.elastic.live.checkpoint_pieces import read_pieces
from meshmorph.elastic.live.execute import execute_transfers
from meshmorph.elastic.live.local_state import (
    HeldPiece,
    LocalState,
    ReshapeError,
    SmallState,
    extract_state,
    install_state,
)
from meshmorph.elastic.moves.build_counts import build_counts
from meshmorph.elastic.moves.layout import Layout, layout_of
from meshmorph.elastic.moves.move_plan import DEFAULT_STAGING_BYTES, MovePlan, plan_move
from meshmorph.elastic.moves.move_time import MoveTime, MoveTimeModel, cpu_cluster, move_time
from meshmorph.plan.runnable_plans import runnable_plans
from meshmorph.run.config import OptimConfig
from meshmorph.run.engine.train_engine import build_engine
from meshmorph.run.model.materialize import state_installed_after
from meshmorph.spec.cluster import parse_cluster
from meshmorph.spec.model import ModelSpec
from meshmorph.spec.plan import Plan


@dataclass(frozen=True, slots=True, kw_only=True)
class ReshapeRequest:
    """A change from Plan A on some processes to Plan B (the same on every process)."""

    model: ModelSpec
    """The model being trained."""
    optim: OptimConfig
    """Its optimizer settings (the new engine's AdamW and LR schedule)."""
    plan_a: Plan
    """The plan running now."""
    processes_a: tuple[int, ...]
    """Process of each rank of Plan A (index = rank)."""
    plan_b: Plan
    """The plan to run next."""
    staying: tuple[int, ...] | None = None
    """Processes that may host Plan B's ranks (a planned leave names the rest); None: any
    process of ``processes_a`` or ``joining``."""
    joining: tuple[int, ...] = ()
    """Processes that hold nothing and may take Plan B's ranks (a join)."""
    seed: int = 0
    """Initialisation seed of the engines (overwritten by the state moved in)."""
    staging_bytes: int = DEFAULT_STAGING_BYTES
    """Most bytes one device receives per round of transfers."""
    verify: bool = True
    """Checksum every transfer (``content_hash``) and refuse a mismatch."""
    cluster: str | None = None
    """Cluster shorthand the move time is predicted on (None: ``cpu:1x<devices>``)."""
    time_model: MoveTimeModel | None = None
    """Coefficients of the predicted move time (None: ``MoveTimeModel()``'s defaults)."""
    lost: tuple[int, ...] = ()
    """Plan A's ranks whose processes are gone with their state (an unplanned loss): what they
    held comes from live replicas, or from ``checkpoint`` where no live holder is left."""
    checkpoint: Path | None = None
    """A committed checkpoint (a ``step-N`` folder) that pieces with no live holder are read
    from, by a partial DCP read of just those pieces (None: such a move is refused)."""


@dataclass(slots=True)
class ReshapeReport:
    """What a move cost: the MovePlan's figures and this process's measurements."""

    move: MovePlan
    """The plan that was executed (devices: Plan A's ranks, joiners after them)."""
    processes_b: tuple[int, ...]
    """Process of each rank of Plan B."""
    times_s: dict[str, float] = field(default_factory=dict)
    """Wall time of each part of the move on this process, named as ``move_time.PARTS`` (and
    ``checkpoint`` where pieces are read from one)."""
    consumed_samples: int | None = None
    """The data position the move carried (None on a process that took no part)."""
    predicted: MoveTime | None = None
    """The predicted time and its parts (``move_time``): the transfers alone with the default
    ``MoveTimeModel``, from the change to the new engine ready with a measured one."""

    @property
    def predicted_time_s(self) -> float:
        return self.predicted.total_s if self.predicted is not None else 0.0

    def figures(self) -> dict[str, Any]:
        """The keys of a ``{"event": "reshape"}`` line (sizes in bytes, times in seconds)."""
        move = self.move
        return {"bytes_moved": move.bytes_moved, "lower_bound_bytes": move.lower_bound_bytes,
                "naive_bytes": move.naive_bytes,
                "busiest_device_bytes": move.busiest_device_bytes, "messages": move.messages,
                "from_checkpoint_bytes": move.checkpoint_bytes,
                "predicted_time_s": self.predicted_time_s,
                "measured_time_s": sum(self.times_s.values()),
                "measured_transfer_s": self.times_s.get("transfer", 0.0),
                "sources": {"kept": sum(t.nbytes for t in move.local_copies),
                            "peers": move.bytes_moved, "checkpoint": move.checkpoint_bytes}}


def clear_mesh_caches() -> None:
    """Empty DTensor's caches keyed by device-mesh value. A DeviceMesh equals any other of the same
    layout, so after a new process group puts this process at another rank, a cached sharding
    decision would hand back the old mesh object and with it the old coordinates (FSDP2 shards
    that claim another rank's rows)."""
    from torch.distributed.tensor import DTensor, _collective_utils, _redistribute

    propagator = DTensor._op_dispatcher.sharding_propagator
    caches = [*vars(propagator).values(),
              getattr(type(propagator), "_propagate_tensor_meta_cached", None),
              getattr(_redistribute, "_gen_transform_infos", None),
              getattr(getattr(_collective_utils, "MeshTopoInfo", None), "build_from_mesh", None)]
    for cache in caches:
        if hasattr(cache, "cache_clear"):
            cache.cache_clear()
    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if native is not None:  # the C++ dispatch fast path keeps its own copy
        native()


def regroup(store_dir: Path, tag: str, me: int, members: Sequence[int],
            timeout_s: float = 120.0) -> bool:
    """Leave the current default process group and, if ``me`` is in ``members``, join a new one
    whose rank ``i`` is process ``members[i]``; whether ``me`` joined. The new group's first act
    is a barrier: gloo connects every pair while forming it, and a member that went on (and left
    or exited) as soon as its own connections were up would close them under a slower peer
    still in its handshake ("Connection closed by peer")."""
    if dist.is_initialized():
        dist.destroy_process_group()
    clear_mesh_caches()
    if me not in members:
        return False
    store = dist.FileStore(str(store_dir / f"store-{tag}"), len(members))
    dist.init_process_group("gloo", store=store, rank=list(members).index(me),
                            world_size=len(members), timeout=timedelta(seconds=timeout_s))
    dist.barrier()
    return True


def plan_the_move(request: ReshapeRequest) -> tuple[MovePlan, Layout, dict[int, int]]:
    """The MovePlan, Plan A's layout, and device id -> process (devices: Plan A's ranks, then
    the joining processes in order)."""
    layout_a = layout_of(request.model, request.plan_a)
    world_a = request.plan_a.world_size
    process_of = dict(enumerate(request.processes_a))
    joiners = list(range(world_a, world_a + len(request.joining)))
    process_of.update(zip(joiners, request.joining, strict=True))
    survivors = [r for r in range(world_a) if r not in request.lost]
    hosts = None
    if request.staying is not None:  # the new ranks run on the devices that stay
        hosts = [d for d, p in sorted(process_of.items()) if p in request.staying]
    move = plan_move(layout_a, layout_of(request.model, request.plan_b), survivors, joiners,
                     staging_bytes=request.staging_bytes, hosts=hosts)
    return move, layout_a, process_of


def _current_group_is(processes: Sequence[int], me: int) -> bool:
    """Whether the default process group spans exactly ``processes`` with rank ``i`` on
    ``processes[i]`` (then it is reused instead of formed again)."""
    return (dist.is_initialized() and me in processes
            and dist.get_world_size() == len(processes)
            and dist.get_rank() == list(processes).index(me))


def _agree(request: ReshapeRequest, state: LocalState | None, root: int, members: list[int],
           formed: int
           ) -> tuple[MovePlan, dict[int, int], dict[str, tuple[int, ...]], SmallState, MoveTime]:
    """The MovePlan, device -> process, global shapes, small state, predicted time and planning
    seconds, computed once on the group's rank ``root`` (the first survivor) and broadcast, so
    every process follows the same plan. ``formed``: process groups formed so far (the
    prediction adds Plan B's where it needs its own)."""
    box: list[Any] = [None]
    if dist.get_rank() == root:
        if state is None:
            raise ReshapeError("the first survivor has no small state to share")
        start = time.perf_counter()
        move, layout_a, process_of = plan_the_move(request)
        processes_b = [process_of[move.placement[r]] for r in range(request.plan_b.world_size)]
        cluster = parse_cluster(request.cluster) if request.cluster else cpu_cluster(move)
        shapes = {k: tuple(t.shape) for k, t in layout_a.tensors.items()}
        small = replace(state.small, rng=torch.empty(0, dtype=torch.uint8))  # ranks keep theirs
        plan_s = time.perf_counter() - start
        model = (replace(request.time_model, plan_s=plan_s) if request.time_model is not None
                 else MoveTimeModel())
        group_b = int(processes_b != members)
        agree_bytes = len(pickle.dumps((move, process_of, shapes, small)))
        predicted = move_time(move, cluster, model=model, groups=formed + group_b,
                              group_b=group_b, build=build_counts(request.model, request.plan_b),
                              state_calls=2 * max(len(request.plan_a.chunks_of(p))
                                                  for p in range(request.plan_a.pp)),
                              agree_bytes=agree_bytes,
                              held=build_counts(request.model, request.plan_a))
        box = [(move, process_of, shapes, small, predicted, plan_s)]
    dist.broadcast_object_list(box, src=root)
    return box[0]


def _pieces_from_checkpoint(request: ReshapeRequest, move: MovePlan, device: int,
                            shapes: dict[str, tuple[int, ...]]) -> list[HeldPiece]:
    """The pieces bound for ``device`` that no live process holds, read from the request's
    checkpoint (none where every piece has a live holder)."""
    if not move.from_checkpoint:
        return []
    if request.checkpoint is None:
        raise ReshapeError(f"{len(move.from_checkpoint)} pieces have no live holder; give "
                           "the newest committed checkpoint to read them from, or resume "
                           "from it (meshmorph run --resume --reshard)")
    return read_pieces(request.checkpoint, [(t.key, t.box) for t in move.from_checkpoint
                                            if t.dst_device == device], shapes)


def reshape_in_memory(request: ReshapeRequest, me: int, engine: Any, *, consumed_samples: int,
                      store_dir: Path, tag: str, device: torch.device | None = None
                      ) -> tuple[Any, ReshapeReport]:
    """Move this process's part of the job from ``engine`` (None on a joining process) to an
    engine of Plan B; returns it (None where this process hosts no rank of Plan B) and the
    report. Collective over every process of the request; no process group is formed that need
    not be (the module docstring's steps 2 and 4)."""
    times: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        times[name] = times.get(name, 0.0) + now - clock
        clock = now

    state: LocalState | None = None
    if engine is not None:
        state = extract_state(engine, consumed_samples=consumed_samples)
    lap("extract")
    alive_a = [p for r, p in enumerate(request.processes_a) if r not in request.lost]
    members = sorted(set(alive_a) | set(request.joining))
    formed = 0
    if not request.joining and not request.lost and _current_group_is(request.processes_a, me):
        members = list(request.processes_a)
    else:
        regroup(store_dir, f"{tag}-move", me, members)
        formed = 1
    lap("group")
    if me not in members:
        raise ReshapeError(f"process {me} is neither alive in plan A {alive_a} nor joining "
                           f"{list(request.joining)}; only they take part in the move")
    move, process_of, shapes, small, predicted, plan_s = _agree(
        request, state, members.index(alive_a[0]), members, formed)
    processes_b = tuple(process_of[move.placement[r]] for r in range(request.plan_b.world_size))
    report = ReshapeReport(move, processes_b, times_s=times,
                           consumed_samples=small.consumed_samples, predicted=predicted)
    small.rng = state.small.rng if state is not None else torch.get_rng_state()
    lap("agree")  # waiting for the first survivor's planning, then the broadcast
    times["plan"] = min(plan_s, times["agree"])
    times["agree"] -= times["plan"]
    device_of = {p: d for d, p in process_of.items() if d in move.devices}
    held = state.pieces if state is not None else {}
    from_checkpoint = _pieces_from_checkpoint(request, move, device_of[me], shapes)
    if move.from_checkpoint:
        lap("checkpoint")
    received = execute_transfers(
        move.transfers, device_of[me], held, shapes,
        rank_of_device={d: members.index(p) for d, p in process_of.items() if p in members},
        staging_bytes=request.staging_bytes, verify=request.verify)
    dist.barrier()  # every transfer arrived and was checked before anything changes
    lap("transfer")
    new_engine = None
    if list(processes_b) == members:
        clear_mesh_caches()
        joined = True
    else:
        joined = regroup(store_dir, f"{tag}-run", me, processes_b)
    lap("group_b")
    if joined:
        with state_installed_after():  # every value is written by install_state below
            new_engine = build_engine(request.model, request.plan_b, request.optim,
                                      seed=request.seed, device=device or torch.device("cpu"))
        lap("build")
        pieces = {key: list(each) for key, each in held.items()}
        for piece in (*received, *from_checkpoint):
            pieces.setdefault(piece.key, []).append(piece)
        install_state(new_engine, pieces, small)
        lap("install")
    return new_engine, report


def replan(model: ModelSpec, world_size: int, *, global_batch: int, dtype: str = "fp32",
           cluster: str | None = None) -> Plan:
    """The planner's best plan for ``world_size`` devices that the runtime accepts, with the
    global batch kept (gradient accumulation absorbs a smaller dp)."""
    found = runnable_plans(model, world_size, global_batch=global_batch, dtype=dtype,
                           cluster=cluster)
    if not found.plans:
        raise ReshapeError(f"the planner found no plan of {model.name} for {world_size} devices "
                           f"with global_batch {global_batch} that the runtime runs "
                           f"({found.refused[:2]}); wait for more devices or restart from the "
                           "checkpoint with a plan file")
    return found.plans[0][0]
