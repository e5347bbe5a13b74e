"""What starting, restarting, reshaping and checkpointing cost, from CM-DARE's measurements.

- VM start-up (request to RUNNING): the measured new-VM totals (means 87 s preemptible, 74 s
  on-demand), drawn at random per start.
- Replacement request delay (reshape): the published mean and standard deviation of the time to
  obtain a requested server (66-78 s), a normal draw, per GPU where measured.
- Training restart: cold (TensorFlow from nothing, 74-91 s) after a restart, warm (14-31 s) after
  a reshape, drawn from the measured samples; then loading the state at the storage bandwidth
  (restart) or moving the lost node's share (reshape) at the inter-node bandwidth.
- Checkpoint write: a fixed cost plus bytes over the storage bandwidth of all nodes writing their
  shards in parallel; the fixed part is the intercept of a line fitted to CM-DARE's 100 checkpoint
  samples (``checkpoint_fit``).
A figure set on the dataclass replaces the measured draw (hand-checked cases, what-ifs).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np

from meshmorph.predict.measurements import measurements


@cache
def checkpoint_fit() -> tuple[float, float]:
    """(seconds, seconds per MB) of CM-DARE's checkpoint time (save + upload) by size."""
    sizes, times = np.array(measurements()["checkpoint_mb_s"]).T
    slope, intercept = np.polyfit(sizes, times, 1)
    return float(intercept), float(slope)


@dataclass(slots=True, kw_only=True)
class Overheads:
    """Recovery and checkpoint costs; None fields are drawn from the measurements."""

    spot: bool = True
    """Start-up of preemptible VMs (longer staging) rather than on-demand ones."""
    gpu: str = ""
    """GPU of the nodes (picks the request-delay measurement: K80, P100, V100; others pooled)."""
    inter_node_gbps: float = 12.5
    """GB/s per GPU between nodes (moves during a reshape)."""
    gpus_per_node: int = 8
    """GPUs per node (each GPU's NIC share moves data)."""
    storage_gbps_per_node: float = 1.0
    """GB/s each node reads or writes its checkpoint shard at (object storage, assumed)."""
    vm_start_s: float | None = None
    """VM start-up, seconds; None: drawn from the measured new-VM totals."""
    request_s: float | None = None
    """Replacement request delay, seconds; None: drawn from the published summary."""
    cold_restart_s: float | None = None
    """Framework restart after a full stop, seconds; None: drawn from the measured samples."""
    warm_restart_s: float | None = None
    """Framework restart on running VMs, seconds; None: drawn from the measured samples."""
    checkpoint_fixed_s: float | None = None
    """Fixed part of a checkpoint write, seconds; None: CM-DARE's fitted intercept."""

    def _pick(self, fixed: float | None, samples: list[float], rng: np.random.Generator) -> float:
        return fixed if fixed is not None else float(rng.choice(samples))

    def vm_start_s_draw(self, rng: np.random.Generator) -> float:
        samples = measurements()["vm_startup_s"]["preemptible" if self.spot else "on-demand"]
        return self._pick(self.vm_start_s, samples, rng)

    def replacement_s(self, rng: np.random.Generator) -> float:
        if self.request_s is not None:
            return self.request_s
        table = measurements()["server_request_s"]
        key = f"{self.gpu.split('-')[0].upper()}/immediate request"
        pairs = [table[key]] if key in table else [v for k, v in table.items() if "immediate" in k]
        mean, std = np.mean([p[0] for p in pairs]), np.mean([p[1] for p in pairs])
        return max(0.0, float(rng.normal(mean, std)))

    def checkpoint_write_s(self, state_bytes: float, nodes: int) -> float:
        fixed = self.checkpoint_fixed_s if self.checkpoint_fixed_s is not None else checkpoint_fit()[0]
        return fixed + state_bytes / (nodes * self.storage_gbps_per_node * 1e9)

    def recover_s(self, *, first: bool, reshape: bool, state_bytes: float, nodes: int,
                  rng: np.random.Generator) -> float:
        """Time from having the nodes to training again."""
        restart = measurements()["training_restart_s"]
        if first:  # a fresh job: cold start, nothing to load
            return self._pick(self.cold_restart_s, restart["cold"], rng)
        if reshape:  # survivors keep their state; one node's share moves over the network
            move_s = state_bytes / max(nodes, 1) / (self.inter_node_gbps * self.gpus_per_node * 1e9)
            return self._pick(self.warm_restart_s, restart["warm"], rng) + move_s
        load_s = state_bytes / (nodes * self.storage_gbps_per_node * 1e9)
        return self._pick(self.cold_restart_s, restart["cold"], rng) + load_s
