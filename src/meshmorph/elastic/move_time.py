"""Predicted wall time of a MovePlan: from the change to the next step.

Each batch is one point-to-point message. Its cost is ``alpha + bytes * beta``: from a measured
fit where ``MoveTimeModel`` holds one (``p2p_alpha_s``/``p2p_beta_s_per_byte``: ``meshmorph
profile``'s ``send_recv/2`` fit, ``MoveTimeModel.from_profile``, or the job's own calibration at
its start, ``move_calibrate.calibrate_move_time``), else from the cost model's link between the
two devices (intra-node or inter-node, at ``CostCoefficients.link_efficiency`` of nominal,
``comm.p2p``). Links are full duplex; a device packs and checksums what it sends before sending
it, sends its batches one after another while it receives its own, and checksums what it
received after (``checksum_bps``, on the device's one core, so in series with the wire).
Processes of one host share its memory bandwidth and cores: at most ``host_streams`` messages
run at full speed at once there, so the host's bytes take at least
``sum(bytes * beta) / host_streams``:

    device  = (sent + received) / checksum_bps + max(sum of its sends, sum of its receives)
    network = max(busiest device, busiest host's bytes * beta / host_streams)
    time    = fixed_s + plan_s + groups * group_s + max(network, checkpoint) + build_s
              + install bytes of the fullest new rank / copy_bps

``groups`` is the number of process groups the move forms (0, 1 or 2: the controller reuses a
group that already has the right ranks in the right order). Checkpoint reads go to storage at
``storage_read_bps`` per device, in parallel with the network. Terms left at 0 are not priced,
so the defaults give the transfers alone on the catalog's links.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
    p2p_alpha_s: float | None = None
    """Measured seconds of one point-to-point message at zero bytes (None: the catalog link)."""
    p2p_beta_s_per_byte: float | None = None
    """Measured seconds per byte of one point-to-point message (None: the catalog link)."""
    host_streams: float = 0.0
    """Messages one host carries at full speed at once (0: no limit, every link its own)."""
    checksum_bps: float = 0.0
    """Bytes per second one process checksums (CRC-32) and packs; 0: not priced."""
    plan_s: float = 0.0
    """Seconds to compute the MovePlan and agree on it (one broadcast)."""
    group_s: float = 0.0
    """Seconds to form one process group over the move's processes."""
    build_s: float = 0.0
    """Seconds to build the new plan's engine (mesh, modules, optimizer) before filling it."""
    copy_bps: float = 0.0
    """Bytes per second one process copies into the new engine's shards; 0: not priced."""

    @classmethod
    def from_profile(cls, profile: Any, **terms: Any) -> MoveTimeModel:
        """The point-to-point terms from a measured Profile's ``send_recv/2`` fit (``meshmorph
        profile``: ping-pong between two ranks, halved); other terms as given."""
        row = profile.collectives.get("send_recv/2")
        if row is None:
            raise ValueError("the profile has no send_recv/2 fit; run meshmorph profile with "
                             "at least 2 processes")
        return cls(p2p_alpha_s=row["alpha_s"], p2p_beta_s_per_byte=row["beta_s_per_byte"],
                   **terms)


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
    """The fixed cost (agreement, barrier, planning, process groups)."""
    busiest_device: int | None
    """The device whose traffic sets ``network_s`` (None: nothing moves)."""
    rebuild_s: float = 0.0
    """Building the new engine and copying the state into it."""


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


def _host_of(cluster: Cluster, device: int) -> int:
    try:
        return node_of(cluster, device)
    except ValueError:
        return 0


def move_time(move: MovePlan, cluster: Cluster, *,
              coefficients: CostCoefficients | None = None,
              model: MoveTimeModel | None = None, groups: int = 0,
              install_bytes: int = 0) -> MoveTime:
    """The predicted time of ``move`` on ``cluster``, with its terms. ``groups``: process groups
    the move forms; ``install_bytes``: the most bytes one new rank holds (what it copies in)."""
    coefficients = coefficients or CostCoefficients()
    model = model or MoveTimeModel()
    measured = model.p2p_alpha_s is not None and model.p2p_beta_s_per_byte is not None
    send = dict.fromkeys(move.devices, 0.0)
    recv = dict.fromkeys(move.devices, 0.0)
    check = dict.fromkeys(move.devices, 0.0)
    host_wire: dict[int, float] = {}
    per_byte_check = 1.0 / model.checksum_bps if model.checksum_bps > 0 else 0.0
    for batch in move.batches:
        if measured:
            wire = batch.nbytes * float(model.p2p_beta_s_per_byte)  # type: ignore[arg-type]
            seconds = float(model.p2p_alpha_s) + wire  # type: ignore[arg-type]
        else:
            seconds = comm.p2p(batch.nbytes, link_between(cluster, batch.src_device,
                                                          batch.dst_device, coefficients))
            wire = seconds
        send[batch.src_device] += seconds  # alpha + bytes * beta per message
        recv[batch.dst_device] += seconds
        check[batch.src_device] += batch.nbytes * per_byte_check  # pack and CRC before sending
        check[batch.dst_device] += batch.nbytes * per_byte_check  # CRC after receiving
        for host in {_host_of(cluster, batch.src_device), _host_of(cluster, batch.dst_device)}:
            host_wire[host] = host_wire.get(host, 0.0) + wire
    busiest = max(move.devices, key=lambda d: check[d] + max(send[d], recv[d]), default=None)
    network_s = check[busiest] + max(send[busiest], recv[busiest]) if busiest is not None else 0.0
    if model.host_streams > 0 and host_wire:
        network_s = max(network_s, max(host_wire.values()) / model.host_streams)
    reads = dict.fromkeys(move.devices, 0)
    for t in move.from_checkpoint:
        reads[t.dst_device] += t.nbytes
    checkpoint_s = max(reads.values(), default=0) / model.storage_read_bps
    fixed_s = model.fixed_s + model.plan_s + groups * model.group_s
    rebuild_s = model.build_s + (install_bytes / model.copy_bps if model.copy_bps > 0 else 0.0)
    return MoveTime(total_s=fixed_s + max(network_s, checkpoint_s) + rebuild_s,
                    network_s=network_s, checkpoint_s=checkpoint_s, fixed_s=fixed_s,
                    busiest_device=busiest if network_s > 0 else None, rebuild_s=rebuild_s)


def predict_move_time_s(move: MovePlan, cluster: Cluster, *,
                        coefficients: CostCoefficients | None = None,
                        model: MoveTimeModel | None = None, groups: int = 0,
                        install_bytes: int = 0) -> float:
    """Predicted seconds from the change to the new engine ready for its next step (with the
    default model: to the last byte in place)."""
    return move_time(move, cluster, coefficients=coefficients, model=model, groups=groups,
                     install_bytes=install_bytes).total_s
