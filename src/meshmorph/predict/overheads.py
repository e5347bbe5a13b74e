"""What starting, restarting, reshaping and checkpointing cost, from CM-DARE's measurements.

- VM start-up (request to RUNNING): the measured new-VM totals (means 87 s preemptible, 74 s
  on-demand), drawn at random per start.
- Training restart: cold (TensorFlow from nothing, 74-91 s) after a restart, warm (14-31 s) after
  a reshape, drawn from the measured samples; after a restart the state is read back from the
  checkpoint at the storage bandwidth (a reshape's move is priced by ``reshape_cost.py``).
- Bounds for deadline decisions: the longest start-up and cold restart the draws can give.
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

    storage_gbps_per_node: float = 1.0
    """GB/s each node reads or writes its checkpoint shard at (object storage, assumed)."""
    vm_start_s: float | None = None
    """VM start-up, seconds; None: drawn from the measured new-VM totals."""
    cold_restart_s: float | None = None
    """Framework restart after a full stop, seconds; None: drawn from the measured samples."""
    warm_restart_s: float | None = None
    """Framework restart on running VMs, seconds; None: drawn from the measured samples."""
    checkpoint_fixed_s: float | None = None
    """Fixed part of a checkpoint write, seconds; None: CM-DARE's fitted intercept."""

    def _pick(self, fixed: float | None, samples: list[float], rng: np.random.Generator) -> float:
        return fixed if fixed is not None else float(rng.choice(samples))

    def vm_start_s_draw(self, rng: np.random.Generator, spot: bool) -> float:
        """VM start-up of a preemptible (longer staging) or an on-demand VM."""
        samples = measurements()["vm_startup_s"]["preemptible" if spot else "on-demand"]
        return self._pick(self.vm_start_s, samples, rng)

    def vm_start_max_s(self, spot: bool) -> float:
        """The longest VM start-up the draws can give (a bound for deadline decisions)."""
        if self.vm_start_s is not None:
            return self.vm_start_s
        return float(max(measurements()["vm_startup_s"]["preemptible" if spot else "on-demand"]))

    def cold_restart_max_s(self) -> float:
        """The longest cold restart the draws can give."""
        if self.cold_restart_s is not None:
            return self.cold_restart_s
        return float(max(measurements()["training_restart_s"]["cold"]))

    def load_s(self, state_bytes: float, nodes: int) -> float:
        """Reading the checkpoint back, every node its shard at the storage bandwidth."""
        return state_bytes / (nodes * self.storage_gbps_per_node * 1e9)

    def warm_restart_s_draw(self, rng: np.random.Generator) -> float:
        """Framework restart on running VMs (a reshape)."""
        return self._pick(self.warm_restart_s, measurements()["training_restart_s"]["warm"], rng)

    def checkpoint_write_s(self, state_bytes: float, nodes: int) -> float:
        fixed = self.checkpoint_fixed_s if self.checkpoint_fixed_s is not None else checkpoint_fit()[0]
        return fixed + self.load_s(state_bytes, nodes)

    def recover_s(self, *, first: bool, state_bytes: float, nodes: int,
                  rng: np.random.Generator) -> float:
        """Time from having the nodes to training again: a cold restart, and after a stop the
        checkpoint read back (a fresh job has nothing to load)."""
        cold = self._pick(self.cold_restart_s, measurements()["training_restart_s"]["cold"], rng)
        return cold if first else cold + self.load_s(state_bytes, nodes)
