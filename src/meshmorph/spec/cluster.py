"""Cluster: groups of identical nodes and the links inside and between them.

Shorthand: ``GPU:NODESxPER_NODE`` (``h100:8x8``), several joined with ``+`` for a mixed cluster
(``h100:4x8+a100-80g:4x8``); anything ending in ``.toml`` is read by ``spec.cluster_toml``.
Ranks are numbered group by group, node by node, so a group's ranks are contiguous.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from meshmorph.spec.gpus import GPUSpec, LinkSpec, gpu, link


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeGroup:
    """Nodes of one GPU type."""

    gpu: GPUSpec
    """The accelerator in every node of the group."""
    num_nodes: int
    """Number of nodes."""
    gpus_per_node: int
    """Accelerators per node."""
    intra_link: LinkSpec
    """Link between accelerators of one node."""
    transient: bool = False
    """Spot/preemptible nodes that the provider may revoke."""
    price_per_gpu_hour: float | None = None
    """USD per GPU-hour (None: the GPU catalog's figure)."""

    def __post_init__(self) -> None:
        if self.num_nodes <= 0 or self.gpus_per_node <= 0:
            raise ValueError(f"a node group needs at least one node of at least one GPU, got "
                             f"{self.num_nodes}x{self.gpus_per_node}")

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node


@dataclass(frozen=True, slots=True, kw_only=True)
class Cluster:
    """Accelerators available to one job."""

    groups: tuple[NodeGroup, ...]
    """Node groups; one group for a homogeneous cluster."""
    inter_link: LinkSpec
    """Link between nodes (the slowest NIC path governs collectives that span nodes)."""
    name: str = ""
    """How the user named the cluster."""
    provider: str = ""
    """Cloud offering its transient nodes come from (``gcp-preemptible``, ``aws-spot``: a
    provider of the cloud catalog, meshmorph.predict); empty: not stated."""

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("a cluster needs at least one node group")

    @property
    def world_size(self) -> int:
        return sum(group.num_gpus for group in self.groups)

    @property
    def homogeneous(self) -> bool:
        return len({group.gpu.name for group in self.groups}) == 1

    @property
    def gpus_per_node(self) -> int:
        """Accelerators per node (the smallest, where groups differ)."""
        return min(group.gpus_per_node for group in self.groups)

    @property
    def num_nodes(self) -> int:
        return sum(group.num_nodes for group in self.groups)

    def describe(self) -> str:
        return "+".join(f"{g.gpu.name}:{g.num_nodes}x{g.gpus_per_node}" for g in self.groups)


_GROUP = re.compile(r"^\s*([A-Za-z0-9._-]+?)\s*:\s*(\d+)\s*[xX]\s*(\d+)\s*$")


def parse_cluster(text: str) -> Cluster:
    """A Cluster from shorthand (``h100:8x8``, ``h100:4x8+a100-80g:4x8``) or a TOML file path."""
    if text.endswith(".toml"):
        from meshmorph.spec.cluster_toml import load_cluster_toml

        return load_cluster_toml(text)
    groups = []
    for part in text.split("+"):
        match = _GROUP.match(part)
        if not match:
            raise ValueError(
                f"cannot read cluster {text!r}: expected GPU:NODESxPER_NODE such as 'h100:8x8' "
                "(join groups with '+'), or a .toml file"
            )
        spec = gpu(match.group(1))
        groups.append(
            NodeGroup(gpu=spec, num_nodes=int(match.group(2)), gpus_per_node=int(match.group(3)),
                      intra_link=link(spec.intra_node_link))
        )
    # between nodes, the slowest default NIC of the groups
    inter = min((link(g.gpu.inter_node_link) for g in groups), key=lambda lk: lk.bandwidth_gbps)
    return Cluster(groups=tuple(groups), inter_link=inter, name=text)
