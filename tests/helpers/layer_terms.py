"""The per-layer pieces the layerwise brute forces (tests/unit/test_layerwise_exact.py and
test_layerwise_pipeline_exact.py) price plans from: the cost model's own figures of one layer,
independently of the planner's programs and bounds."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

from meshmorph.cost.model import CostModel
from meshmorph.cost.rank_terms import head_loss_bytes, rank_memory_terms
from meshmorph.cost.segments import layer_plan
from meshmorph.spec.catalog import load_model
from meshmorph.spec.cluster import parse_cluster
from meshmorph.spec.gpus import GPUSpec
from meshmorph.spec.model import Recompute
from meshmorph.spec.plan import LayerStrategy, Plan


def a100_cost(name: str, devices: int, memory_gib: float | None = None) -> CostModel:
    """The catalog model ``name`` on one node of ``devices`` A100-40G (with ``memory_gib`` of
    memory each, when given)."""
    cluster = parse_cluster(f"a100-40g:1x{devices}")
    if memory_gib is not None:
        group = cluster.groups[0]
        cluster = replace(cluster, groups=(replace(group, gpu=replace(group.gpu,
                                                                    memory_gib=memory_gib)),))
    return CostModel(load_model(name), cluster)


def layer_terms(cost: CostModel, plan: Plan, pp_rank: int, index: int, strategy: LayerStrategy,
                recompute: Recompute, gpu: GPUSpec, *, drop_tied: bool = False) -> SimpleNamespace:
    """Layer ``index`` under ``strategy`` priced alone by the cost model's own pieces
    (``CostModel.layer_alone`` under its ``layer_plan``, ``rank_memory_terms``,
    ``head_loss_bytes``): its per-micro-batch times, tail and the bytes it adds on its rank."""
    sub = layer_plan(plan, strategy)
    piece, tail = cost.layer_alone(sub, index, recompute, gpu, drop_tied=drop_tied)
    terms = rank_memory_terms(cost, sub, pp_rank, gpu)
    return SimpleNamespace(
        fwd_s=piece.fwd_s, bwd_s=piece.bwd_s, wgrad_s=piece.wgrad_s, tail_s=tail,
        param_bytes=piece.params * terms.bytes_per_param,
        stored_bytes=piece.activation_bytes * terms.in_flight,
        loss_bytes=head_loss_bytes(cost, sub, pp_rank) if index == cost.model.num_layers - 1
        else 0.0, working_bytes=piece.working_bytes,
        gather_bytes=piece.params * terms.gather_bytes_per_param)
