"""Predicted wall time of a MovePlan, from the cost model's link model (``cost/comm.py``).

Each batch is one point-to-point message over the link between its two devices: the intra-node
link where both sit in one node, the inter-node link otherwise, each at the cost model's achieved
bandwidth (``CostCoefficients.link_efficiency`` of nominal): ``alpha + bytes / beta``
(``comm.p2p``). Links are full duplex and a device sends its batches one after another while it
receives its own, so the move lasts as long as its busiest direction on any device:

    time = fixed_s + max over devices of max(sum of its sends, sum of its receives)

Checkpoint reads go to storage at ``storage_read_bps`` per device, in parallel with the network.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshmorph.cost import comm
from meshmorph.cost.coefficients import CostCoefficients
from meshmorph.elastic.move_plan import MovePlan
from meshmorph.spec.cluster import Cluster


@dataclass(frozen=True, slots=True, kw_only=True)
class MoveTimeModel:
    """The terms of a move's predicted time that the link model does not give."""

    fixed_s: float = 0.05
    """Seconds every reshape pays whatever it moves: agreeing on the MovePlan (one broadcast)
    and the barrier that ends the move."""
    storage_read_bps: float = 2e9
    """Bytes per second one device reads from the checkpoint's storage."""


@dataclass(frozen=True, slots=True)
class MoveTime:
    """A predicted move time and the terms that made it."""

    total_s: float
    """Predicted wall time of the move."""
    network_s: float
    """The busiest device's busiest direction over the network."""
    checkpoint_s: float
    """The longest checkpoint read of one device."""
    fixed_s: float
    """The fixed cost."""
    busiest_device: int | None
    """The device whose traffic sets ``network_s`` (None: nothing moves)."""


def node_of(cluster: Cluster, device: int) -> int:
    """Node index of a device (cluster ranks run group by group, node by node)."""
    node, first = 0, 0
    for group in cluster.groups:
        if device < first + group.num_gpus:
            return node + (device - first) // group.gpus_per_node
        first += group.num_gpus
        node += group.num_nodes
    raise ValueError(f"device {device} is outside the cluster's {cluster.world_size} devices; "
                     "give a cluster with at least as many devices as the move uses")


def link_between(cluster: Cluster, src: int, dst: int,
                 coefficients: CostCoefficients) -> comm.Link:
    """The effective link a message from ``src`` to ``dst`` crosses."""
    if node_of(cluster, src) == node_of(cluster, dst):
        node, first = node_of(cluster, src), 0
        for group in cluster.groups:  # the group the node belongs to
            if node < first + group.num_nodes:
                return comm.Link.from_spec(group.intra_link, coefficients.link_efficiency)
            first += group.num_nodes
    return comm.Link.from_spec(cluster.inter_link, coefficients.link_efficiency)


def move_time(move: MovePlan, cluster: Cluster, *,
              coefficients: CostCoefficients | None = None,
              model: MoveTimeModel | None = None) -> MoveTime:
    """The predicted time of ``move`` on ``cluster``, with its terms."""
    coefficients = coefficients or CostCoefficients()
    model = model or MoveTimeModel()
    send = dict.fromkeys(move.devices, 0.0)
    recv = dict.fromkeys(move.devices, 0.0)
    for batch in move.batches:
        seconds = comm.p2p(batch.nbytes, link_between(cluster, batch.src_device,
                                                      batch.dst_device, coefficients))
        send[batch.src_device] += seconds  # alpha + bytes / beta per message
        recv[batch.dst_device] += seconds
    busiest = max(move.devices, key=lambda d: max(send[d], recv[d]), default=None)
    network_s = max(send[busiest], recv[busiest]) if busiest is not None else 0.0
    reads = dict.fromkeys(move.devices, 0)
    for t in move.from_checkpoint:
        reads[t.dst_device] += t.nbytes
    checkpoint_s = max(reads.values(), default=0) / model.storage_read_bps
    return MoveTime(total_s=model.fixed_s + max(network_s, checkpoint_s), network_s=network_s,
                    checkpoint_s=checkpoint_s, fixed_s=model.fixed_s,
                    busiest_device=busiest if network_s > 0 else None)


def predict_move_time_s(move: MovePlan, cluster: Cluster, *,
                        coefficients: CostCoefficients | None = None,
                        model: MoveTimeModel | None = None) -> float:
    """Predicted seconds from the start of the move to the last byte in place."""
    return move_time(move, cluster, coefficients=coefficients, model=model).total_s
