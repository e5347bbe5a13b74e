"""A training run as the simulator sees it: steps to go, the step time on however many nodes are
up (the planner's best plan for them, cached) and checkpoint bytes."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from meshmorph.cost.state import compute_bytes
from meshmorph.plan.search import PlanDoesNotFit, search
from meshmorph.plan.space import SearchOptions
from meshmorph.schedule.table import Schedule
from meshmorph.spec.cluster import Cluster
from meshmorph.spec.model import ModelSpec, Recompute
from meshmorph.spec.plan import Plan, PlanError

OPTIMIZER_BYTES_PER_PARAM = 12.0
"""fp32 master weights and Adam's two fp32 moments, saved beside the compute-dtype weights."""
_PLANS: dict[tuple[object, ...], Plan | None] = {}
"""Planner results by (model, cluster, batch, dtype): the simulator asks for the same sizes often."""
DEFAULT_TOKENS_PER_STEP = 2**21
"""Global batch of about 2 M tokens (Llama 2's 4 M halved for smaller jobs) unless given."""


@dataclass(slots=True)
class TrainingJob:
    """A model trained for a number of steps on a homogeneous cluster that may shrink."""

    model: ModelSpec
    """What is trained."""
    cluster: Cluster
    """All nodes of the job (one GPU type)."""
    global_batch: int
    """Sequences per step; fixed across reshapes (same math at every size)."""
    total_steps: int
    """Steps to train."""
    dtype: str = "bf16"
    """Compute dtype."""
    _step_s: dict[int, float | None] = field(default_factory=dict)
    """Step time per node count (None: no plan fits), filled as asked."""

    def __post_init__(self) -> None:
        if not self.cluster.homogeneous:
            raise ValueError(f"simulate needs one GPU type, got {self.cluster.describe()}; "
                             "simulate each node group as its own cluster")
        if self.total_steps < 1:
            raise ValueError(f"a run needs at least one step, got {self.total_steps}")

    @property
    def nodes(self) -> int:
        return self.cluster.num_nodes

    @property
    def gpus_per_node(self) -> int:
        return self.cluster.gpus_per_node

    def sub_cluster(self, nodes: int) -> Cluster:
        group = replace(self.cluster.groups[0], num_nodes=nodes)
        return replace(self.cluster, groups=(group,), name=f"{self.cluster.name}[{nodes} nodes]")

    def plan(self, nodes: int) -> Plan | None:
        """The planner's fastest plan on ``nodes`` nodes; None when no plan fits them."""
        cluster = self.sub_cluster(nodes)
        key = (self.model.name, self.model.seq_len, self.model.num_params, repr(cluster.groups),
               repr(cluster.inter_link), self.global_batch, self.dtype)
        if key not in _PLANS:
            # a 2% optimality gap and a small branch-and-bound budget: seconds per cluster size
            options = SearchOptions(top_k=1, dtype=self.dtype, tolerance=0.02, max_nodes=50,
                                    schedules=(Schedule.ONE_F_ONE_B,), max_micro_batch=4,
                                    recompute=(Recompute.NONE, Recompute.FULL))
            try:
                result = search(self.model, cluster, global_batch=self.global_batch, options=options)
                _PLANS[key] = result.plans[0]
            except (PlanDoesNotFit, PlanError):
                _PLANS[key] = None
        return _PLANS[key]

    def step_time_s(self, nodes: int) -> float | None:
        if nodes not in self._step_s:
            plan = self.plan(nodes)
            self._step_s[nodes] = None if plan is None else float(plan.predicted["step_time_s"])
        return self._step_s[nodes]

    @property
    def checkpoint_bytes(self) -> float:
        """Weights in the compute dtype plus fp32 optimizer state."""
        return self.model.num_params * (compute_bytes(self.dtype) + OPTIMIZER_BYTES_PER_PARAM)


def steps_for_tokens(tokens: float, global_batch: int, seq_len: int) -> int:
    """Optimizer steps that see ``tokens`` tokens (the last step may overshoot)."""
    return max(1, math.ceil(tokens / (global_batch * seq_len)))


def default_global_batch(seq_len: int, world_size: int) -> int:
    """About ``DEFAULT_TOKENS_PER_STEP`` tokens, a power of two, at least one sequence per GPU."""
    sequences = max(1, DEFAULT_TOKENS_PER_STEP // seq_len)
    return max(2 ** math.ceil(math.log2(world_size)), 2 ** round(math.log2(sequences)))
