"""The GPU types a configuration uses, and each layer's least per-micro-batch times over them:
what every lower bound of the search starts from (a rank's work is at least the sum of its
layers' fastest times)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from meshmorph.cost.model import CostModel
from meshmorph.spec.gpus import GPUSpec
from meshmorph.spec.model import Recompute
from meshmorph.spec.plan import Plan


def cluster_gpu(cost: CostModel, name: str) -> GPUSpec:
    """The cluster's GPU type of that name (its memory and peaks, which a cluster may set
    apart from the catalog's), as ``CostModel.stage_gpu`` resolves a stage's GPU."""
    for group in cost.cluster.groups:
        if group.gpu.name == name:
            return group.gpu
    raise ValueError(f"no GPU {name!r} in the cluster ({cost.cluster.describe()})")


def unique_gpus(cost: CostModel, names: Iterable[str]) -> list[GPUSpec]:
    """The distinct GPU types among ``names``, in first-seen order."""
    return [cluster_gpu(cost, name) for name in dict.fromkeys(names)]


@dataclass(frozen=True, slots=True)
class FastestLayer:
    """A layer's least per-micro-batch times over the GPU types in use, without recompute."""

    fwd_s: float
    """Least forward."""
    bwd_s: float
    """Least backward (input and weight gradients)."""
    bgrad_s: float
    """Least input-gradient part of the backward (zero-bubble B op)."""
    wgrad_s: float
    """Least weight-gradient part of the backward (zero-bubble W op)."""
    work_s: float
    """Least forward + backward."""
    chain_s: float
    """Least forward + the backward the pipeline chain waits for (input gradient only for ZB)."""


def fastest_layer_times(cost: CostModel, plan: Plan, gpus: Sequence[GPUSpec]) -> list[FastestLayer]:
    """Per layer, the least times over ``gpus`` (recompute only ever adds time); layers of one
    cost class (``LayerCoster.classes``: alike blocks) share one figure."""
    coster = cost.coster(plan)
    zb = plan.schedule.split_backward
    out = []
    by_class: dict[object, FastestLayer] = {}
    for index in range(cost.model.num_layers):
        found = by_class.get(coster.classes[index])
        if found is None:
            costs = [coster.layer(index, g, plan.micro_batch, plan.tp, plan.sequence_parallel,
                                  Recompute.NONE) for g in gpus]
            found = by_class[coster.classes[index]] = FastestLayer(
                fwd_s=min(c.fwd_s for c in costs), bwd_s=min(c.bwd_s for c in costs),
                bgrad_s=min(c.bgrad_s for c in costs), wgrad_s=min(c.wgrad_s for c in costs),
                work_s=min(c.fwd_s + c.bwd_s for c in costs),
                chain_s=min(c.fwd_s + (c.bgrad_s if zb else c.bwd_s) for c in costs))
        out.append(found)
    return out
