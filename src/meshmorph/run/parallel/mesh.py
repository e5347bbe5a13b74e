"""The device meshes of a Plan: named dims ``pp``, ``dp``, ``tp``; everything else asks them by name.

Ranks follow the Plan's layout, tensor parallel innermost: ``rank = (pp_rank * dp + dp_rank) * tp
+ tp_rank``, which is the row-major order of a ``(pp, dp, tp)`` mesh. A plan whose layers split a
stage's D = tp x dp devices other ways (per-layer strategies) gets one more ``(pp, D / tp, tp)``
mesh per other tp degree, over the same ranks in the same order, and the process groups that
move activations between them (run/parallel/redistribute.py); every rank makes all of them, in
one order, as ``new_group`` requires.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshmorph.run.parallel.redistribute import LayoutGroups
from meshmorph.spec.plan import Plan
from meshmorph.spec.runnable import refuse_context_parallel, tp_degrees_of

MESH_DIMS = ("pp", "dp", "tp")
"""Names of the mesh dimensions, outermost first."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SegmentMesh:
    """One (dp, tp) split of a pipeline stage's devices, and this rank's place in it: the mesh a
    run of layers sharing a strategy is parallelized on."""

    tp: int
    """Tensor-parallel degree."""
    dp: int
    """Data-parallel degree (stage devices / tp)."""
    mesh: DeviceMesh
    """2-D mesh with dims ("dp", "tp") over this rank's stage."""
    tp_mesh: DeviceMesh
    """Its "tp" dim through this rank."""
    dp_mesh: DeviceMesh
    """Its "dp" dim through this rank."""

    @classmethod
    def of(cls, mesh: DeviceMesh) -> SegmentMesh:
        """The stage slice of a ("pp", "dp", "tp") mesh."""
        return cls(tp=mesh.size(2), dp=mesh.size(1), mesh=mesh["dp", "tp"], tp_mesh=mesh["tp"],
                   dp_mesh=mesh["dp"])


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainMesh:
    """The job's DeviceMesh, this rank's coordinates on it, and the other splits its layers use."""

    mesh: DeviceMesh
    """3-D mesh with dims ("pp", "dp", "tp") of sizes (plan.pp, plan.dp, plan.tp)."""
    pp_rank: int
    """This rank's pipeline coordinate."""
    dp_rank: int
    """This rank's data-parallel coordinate."""
    tp_rank: int
    """This rank's tensor-parallel coordinate."""
    splits: dict[int, SegmentMesh]
    """tp degree -> the stage split of that degree (the plan's own tp included)."""
    moves: LayoutGroups | None = None
    """The groups that move activations between splits; None when the plan uses one."""

    @property
    def pp(self) -> int:
        return self.mesh.size(0)

    @property
    def dp(self) -> int:
        return self.mesh.size(1)

    @property
    def tp(self) -> int:
        return self.mesh.size(2)

    def sub(self, *names: str) -> DeviceMesh:
        """The sub-mesh over the named dims (``sub("dp", "tp")``)."""
        return self.mesh[names if len(names) > 1 else names[0]]

    def group(self, name: str) -> dist.ProcessGroup:
        """The process group of one dim through this rank."""
        return self.mesh.get_group(name)


def build_mesh(plan: Plan, device_type: str) -> TrainMesh:
    """The meshes for ``plan`` over the initialised default process group."""
    refuse_context_parallel(plan)
    world = dist.get_world_size()
    if world != plan.world_size:
        raise ValueError(
            f"plan needs tp {plan.tp} x pp {plan.pp} x dp {plan.dp} = {plan.world_size} ranks but "
            f"{world} processes were started; start {plan.world_size} or change the plan"
        )
    mesh = init_device_mesh(device_type, (plan.pp, plan.dp, plan.tp), mesh_dim_names=MESH_DIMS)
    pp_rank, dp_rank, tp_rank = mesh.get_coordinate()  # type: ignore[misc]
    devices = plan.tp * plan.dp
    splits = {plan.tp: SegmentMesh.of(mesh)}
    degrees = sorted(tp_degrees_of(plan))
    for tp in degrees:  # every rank, in one order
        if tp not in splits:
            splits[tp] = SegmentMesh.of(init_device_mesh(
                device_type, (plan.pp, devices // tp, tp), mesh_dim_names=MESH_DIMS))
    moves = None
    if len(degrees) > 1:
        moves = LayoutGroups(pp_rank * devices, devices, plan.pp)
        moves.tp_groups = {tp: split.tp_mesh.get_group() for tp, split in splits.items() if tp > 1}
        for i, low in enumerate(degrees):  # every pair's all-gather groups, in one order
            for high in degrees[i + 1:]:
                moves.groups(low, high)
    return TrainMesh(mesh=mesh, pp_rank=pp_rank, dp_rank=dp_rank, tp_rank=tp_rank,
                     splits=splits, moves=moves)
