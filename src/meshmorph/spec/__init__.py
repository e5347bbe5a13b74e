"""Model and cluster specifications. Imports no torch."""

from meshmorph.schedule.table import Schedule
from meshmorph.spec.catalog import MODEL_CATALOG, catalog_model, load_model
from meshmorph.spec.cluster import Cluster, NodeGroup, parse_cluster
from meshmorph.spec.gpus import GPU_CATALOG, LINKS, GPUSpec, LinkSpec, gpu, link
from meshmorph.spec.model import ActivationBytes, LayerKind, LayerSpec, ModelSpec, Recompute
from meshmorph.spec.plan import Plan, PlanError, StagePlan
from meshmorph.spec.transformer import TransformerShape, build_transformer

__all__ = [
    "GPU_CATALOG", "LINKS", "MODEL_CATALOG", "ActivationBytes", "Cluster", "GPUSpec", "LayerKind",
    "LayerSpec", "LinkSpec", "ModelSpec", "NodeGroup", "Plan", "PlanError", "Recompute", "Schedule",
    "StagePlan", "TransformerShape",
    "build_transformer", "catalog_model", "gpu", "link", "load_model", "parse_cluster",
]
