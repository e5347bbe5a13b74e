"""The device mesh of a Plan: named dims ``pp``, ``dp``, ``tp``; everything else asks it by name.

Ranks follow the Plan's layout, tensor parallel innermost: ``rank = (pp_rank * dp + dp_rank) * tp
+ tp_rank``, which is the row-major order of a ``(pp, dp, tp)`` mesh.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshmorph.spec.plan import Plan
from meshmorph.spec.runnable import refuse_context_parallel

MESH_DIMS = ("pp", "dp", "tp")
"""Names of the mesh dimensions, outermost first."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainMesh:
    """The job's DeviceMesh and this rank's coordinates on it."""

    mesh: DeviceMesh
    """3-D mesh with dims ("pp", "dp", "tp") of sizes (plan.pp, plan.dp, plan.tp)."""
    pp_rank: int
    """This rank's pipeline coordinate."""
    dp_rank: int
    """This rank's data-parallel coordinate."""
    tp_rank: int
    """This rank's tensor-parallel coordinate."""

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
    """The mesh for ``plan`` over the initialised default process group."""
    refuse_context_parallel(plan)
    world = dist.get_world_size()
    if world != plan.world_size:
        raise ValueError(
            f"plan needs tp {plan.tp} x pp {plan.pp} x dp {plan.dp} = {plan.world_size} ranks but "
            f"{world} processes were started; start {plan.world_size} or change the plan"
        )
    mesh = init_device_mesh(device_type, (plan.pp, plan.dp, plan.tp), mesh_dim_names=MESH_DIMS)
    pp_rank, dp_rank, tp_rank = mesh.get_coordinate()  # type: ignore[misc]
    return TrainMesh(mesh=mesh, pp_rank=pp_rank, dp_rank=dp_rank, tp_rank=tp_rank)
