"""Predicted wall time of a MovePlan, from the change to the new engine ready for its next step,
as the sum of the parts the executor times (``PARTS``, ``controller.reshape_in_memory``'s laps),
each priced from what it does and from figures measured on the job's own processes
(``move_calibrate.calibrate_move_time``); each part is its slowest process's time:

- ``extract``: Plan A's state tensors read out of the busiest old rank's engine, plus its
  state-dict calls; ``group`` / ``group_b``: process groups formed for the move and for Plan B;
  ``plan``: the MovePlan computed on the first survivor; ``agree``: its broadcast and the
  barrier after the transfers; ``transfer``: below;
- ``build``: Plan B's engine on its slowest rank, from that rank's ``BuildCounts`` (device mesh,
  modules on meta, tensor parallelism, FSDP2, storage); ``install``: parameters copied into
  their shards and AdamW's moments created and filled.

Transfers. Each batch is one message of ``alpha + bytes * beta``: a measured fit where
``MoveTimeModel`` holds one (``meshmorph profile``'s ``send_recv/2``, or the job's own
calibration), else the cost model's link between the two devices (``comm.p2p``). Links are full
duplex; a device packs and checksums what it sends and checksums what it received on its one
core, in series with the wire; the processes of one host share its memory bandwidth, so at most
``host_streams`` messages run at full speed there at once:

    device   = (sent + received) / checksum_bps + max(sum of its sends, sum of its receives)
    transfer = max(busiest device, busiest host's bytes * beta / host_streams, checkpoint)

Checkpoint reads go to storage at ``storage_read_bps`` per device, in parallel with the network.
Terms left at 0 are not priced, so the defaults give the transfers alone on the catalog's links.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from meshmorph.cost import comm
from meshmorph.cost.coefficients import CostCoefficients
from meshmorph.elastic.moves.build_counts import BuildCounts
from meshmorph.elastic.moves.move_plan import MovePlan
from meshmorph.spec.cluster import Cluster, parse_cluster

PARTS = ("extract", "group", "plan", "agree", "transfer", "group_b", "build", "install")
"""The parts of a move, in the order they run (the executor's laps carry the same names)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MoveTimeModel:
    """The measured rates and per-item costs a move's predicted time is priced from."""

    fixed_s: float = 0.05
    """Seconds every reshape pays whatever it moves: the barrier that ends the transfers and the
    MovePlan's broadcast where ``agree_s_per_byte`` is 0."""
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
    """Seconds to compute the MovePlan (measured on the first survivor as it plans)."""
    agree_s: float = 0.0
    """Seconds of broadcasting a pickled object to the move's processes at zero bytes."""
    agree_s_per_byte: float = 0.0
    """Seconds per pickled byte of that broadcast."""
    group_s: float = 0.0
    """Seconds to form one process group over the move's processes (store, connections)."""
    group_call_s: float = 0.0
    """Seconds of one ``new_group`` call of a device mesh that connects nothing (a group of one
    process, or one this process is not in)."""
    mesh_group_s: float = 0.0
    """Seconds to form one device-mesh group of two processes that this process joins, beyond
    the call itself."""
    state_tensor_s: float = 0.0
    """Seconds to take one state tensor out of an engine (state-dict entry, local box)."""
    plain_state_tensor_s: float = 0.0
    """The same for a plain tensor (not a DTensor: no local box to compute); 0: priced at
    ``state_tensor_s``."""
    state_call_s: float = 0.0
    """Seconds of one state-dict read beyond its tensors (an extract makes two per model part:
    the model's and the optimizer's)."""
    meta_tensor_s: float = 0.0
    """Seconds to build one parameter tensor's module on the meta device."""
    tp_tensor_s: float = 0.0
    """Seconds to apply a tensor-parallel style to one parameter tensor (on meta)."""
    fsdp_unit_s: float = 0.0
    """Seconds of one ``fully_shard`` call beyond its tensors."""
    fsdp_tensor_s: float = 0.0
    """Seconds FSDP2 spends per parameter tensor it shards."""
    materialize_tensor_s: float = 0.0
    """Seconds per sharded tensor of giving it storage (``to_empty``) and zeroing it, beyond the
    bytes."""
    plain_materialize_tensor_s: float = 0.0
    """The same for a plain tensor (a DDP or pipeline-only rank's); 0: priced at
    ``materialize_tensor_s``."""
    zero_bps: float = 0.0
    """Bytes per second one process allocates fresh memory and zeroes it; 0: not priced."""
    copy_bps: float = 0.0
    """Bytes per second one process copies into memory it has already touched (a parameter's
    shard); 0: not priced."""
    fresh_copy_bps: float = 0.0
    """Bytes per second one process copies into freshly allocated memory (AdamW's moments); 0:
    priced at ``copy_bps``."""
    install_tensor_s: float = 0.0
    """Seconds per parameter tensor of the install beyond its bytes (local boxes, the moments'
    ``empty_like``, AdamW's state entry)."""
    build_s: float = 0.0
    """Seconds added to the build whatever the plan (0: the build is priced from its counts)."""

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

    def build_time_s(self, counts: BuildCounts) -> float:
        """Seconds one rank takes to build its engine of a plan (before the install)."""
        mesh = counts.mesh_calls * self.group_call_s + len(counts.mesh_groups) * self.mesh_group_s
        modules = counts.tensors * self.meta_tensor_s + counts.tp_tensors * self.tp_tensor_s \
            + counts.fsdp_units * self.fsdp_unit_s + counts.fsdp_tensors * self.fsdp_tensor_s
        plain = self.plain_materialize_tensor_s or self.materialize_tensor_s
        storage = counts.dtensors * self.materialize_tensor_s \
            + (counts.tensors - counts.dtensors) * plain \
            + (counts.param_bytes / self.zero_bps if self.zero_bps > 0 else 0.0)
        return self.build_s + mesh + modules + storage

    def extract_time_s(self, counts: BuildCounts) -> float:
        """Seconds one rank takes to read its parameters and both moments out of its engine,
        beyond the state-dict calls."""
        plain = self.plain_state_tensor_s or self.state_tensor_s
        return 3 * (counts.dtensors * self.state_tensor_s
                    + (counts.tensors - counts.dtensors) * plain)

    def install_time_s(self, counts: BuildCounts) -> float:
        """Seconds one rank takes to fill its new engine (parameters and AdamW's moments)."""
        copy = counts.param_bytes / self.copy_bps if self.copy_bps > 0 else 0.0
        fresh = self.fresh_copy_bps or self.copy_bps
        moments = counts.moment_bytes / fresh if fresh > 0 else 0.0
        return copy + moments + counts.tensors * self.install_tensor_s


@dataclass(frozen=True, slots=True)
class MoveTime:
    """A predicted move time and the parts that make it."""

    total_s: float
    """Predicted wall time of the move (the sum of ``parts``)."""
    network_s: float
    """The busiest device's busiest direction over the network."""
    checkpoint_s: float
    """The longest checkpoint read of one device."""
    fixed_s: float
    """Agreement, planning and process groups (``group``, ``plan``, ``agree``, ``group_b``)."""
    busiest_device: int | None
    """The device whose traffic sets ``network_s`` (None: nothing moves)."""
    rebuild_s: float = 0.0
    """Building the new engine and filling it (``build`` + ``install``)."""
    parts: dict[str, float] = field(default_factory=dict)
    """Seconds of each part (``PARTS``), on the process that is slowest at it."""


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


def cpu_cluster(move: MovePlan) -> Cluster:
    """One CPU node with a device for every device id of ``move`` (where no cluster is given)."""
    return parse_cluster(f"cpu:1x{max(move.devices, default=0) + 1}")


def link_between(cluster: Cluster, src: int, dst: int,
                 coefficients: CostCoefficients) -> comm.Link:
    """The effective link a message from ``src`` to ``dst`` crosses."""
    if node_of(cluster, src) != node_of(cluster, dst):
        return comm.Link.from_spec(cluster.inter_link, coefficients.link_efficiency)
    ends = itertools.accumulate(group.num_gpus for group in cluster.groups)
    group = next(g for g, end in zip(cluster.groups, ends, strict=True) if src < end)
    return comm.Link.from_spec(group.intra_link, coefficients.link_efficiency)


def _host_of(cluster: Cluster, device: int) -> int:
    try:
        return node_of(cluster, device)
    except ValueError:
        return 0


def _transfer(move: MovePlan, cluster: Cluster, coefficients: CostCoefficients,
              model: MoveTimeModel) -> tuple[float, float, int | None]:
    """(network seconds, checkpoint seconds, busiest device) of the move's transfers."""
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
    return network_s, checkpoint_s, busiest if network_s > 0 else None


def move_time(move: MovePlan, cluster: Cluster, *,
              coefficients: CostCoefficients | None = None,
              model: MoveTimeModel | None = None, groups: int = 0, group_b: int | None = None,
              install_bytes: int = 0, build: Mapping[int, BuildCounts] | None = None,
              state_tensors: int = 0, state_calls: int = 0, agree_bytes: int = 0,
              held: Mapping[int, BuildCounts] | None = None) -> MoveTime:
    """The predicted time of ``move`` on ``cluster``, part by part. ``groups``: process groups
    the move forms in all, of which ``group_b`` (None: all but the first) for Plan B;
    ``build``: Plan B's ``BuildCounts`` by rank (None: the build is ``model.build_s`` and the
    install ``install_bytes`` / ``copy_bps``); ``state_tensors``: the most state tensors one
    rank of Plan A holds, read in ``state_calls`` state-dict reads (``held``: Plan A's
    ``BuildCounts`` by rank, which tell DTensors from plain tensors; given, they replace
    ``state_tensors``); ``agree_bytes``: the pickled MovePlan's size."""
    coefficients = coefficients or CostCoefficients()
    model = model or MoveTimeModel()
    network_s, checkpoint_s, busiest = _transfer(move, cluster, coefficients, model)
    group_b = max(groups - 1, 0) if group_b is None else group_b
    if build:
        build_s = max(model.build_time_s(c) for c in build.values())
        install_s = max(model.install_time_s(c) for c in build.values())
    else:
        build_s = model.build_s
        install_s = install_bytes / model.copy_bps if model.copy_bps > 0 else 0.0
    extract_s = max((model.extract_time_s(c) for c in held.values()), default=0.0) if held \
        else state_tensors * model.state_tensor_s
    parts = {"extract": extract_s + state_calls * model.state_call_s,
             "group": (groups - group_b) * model.group_s,
             "plan": model.plan_s,
             "agree": model.fixed_s + (model.agree_s + agree_bytes * model.agree_s_per_byte
                                       if model.agree_s_per_byte > 0 else 0.0),
             "transfer": max(network_s, checkpoint_s),
             "group_b": group_b * model.group_s,
             "build": build_s, "install": install_s}
    fixed_s = parts["group"] + parts["plan"] + parts["agree"] + parts["group_b"]
    return MoveTime(total_s=sum(parts.values()), network_s=network_s, checkpoint_s=checkpoint_s,
                    fixed_s=fixed_s, busiest_device=busiest, rebuild_s=build_s + install_s,
                    parts=parts)


def predict_move_time_s(move: MovePlan, cluster: Cluster, *,
                        model: MoveTimeModel | None = None) -> float:
    """Predicted seconds from the change to the new engine ready for its next step (with the
    default model: to the last byte in place)."""
    return move_time(move, cluster, model=model).total_s
