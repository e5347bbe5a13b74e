"""Estimate: a plan's predicted figures with the terms that made them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

GIB = 2**30


@dataclass(frozen=True, slots=True, kw_only=True)
class StageMemory:
    """Peak bytes on one rank of one pipeline stage, by what holds them."""

    params: float
    """16-bit (or fp32) parameters held after ZeRO sharding."""
    grads: float
    """Gradients held after ZeRO sharding."""
    optimizer: float
    """Optimizer state (fp32 master weights and Adam moments) after ZeRO sharding."""
    activations: float
    """Activations of the in-flight micro-batches, plus the working set of a recomputed layer."""
    buffers: float
    """Temporary buffers: ZeRO-3 parameter gathers, communication buckets."""
    reserved: float
    """CUDA context and allocator reserve."""
    in_flight_microbatches: float
    """Micro-batches whose activations the stage holds at its peak."""

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers + self.reserved


@dataclass(frozen=True, slots=True, kw_only=True)
class Estimate:
    """Predicted time, throughput and memory of one plan on one cluster."""

    step_time_s: float
    """Time of one optimizer step."""
    tokens_per_s: float
    """Global batch tokens / step time."""
    tflops_per_gpu: float
    """Hardware TFLOP/s per GPU, counting recomputed forwards (as Megatron-LM reports)."""
    model_tflops_per_gpu: float
    """Model TFLOP/s per GPU (no recompute counted): the MFU numerator."""
    mfu: float
    """Model FLOPs utilisation: model FLOP/s / (GPUs x dense peak)."""
    bubble_fraction: float
    """Idle share of the pipeline ranks over the simulated schedule."""
    memory: tuple[StageMemory, ...]
    """Peak memory of one rank of each pipeline stage."""
    memory_budget_bytes: tuple[float, ...]
    """Device memory of each pipeline stage's GPU."""
    breakdown_s: dict[str, float] = field(default_factory=dict)
    """Step time split: compute, recompute, tp_comm, pp_bubble, dp_comm_exposed, optimizer, ..."""
    stage_times_s: tuple[tuple[float, float], ...] = ()
    """(forward, backward) seconds per micro-batch for each model chunk."""

    @property
    def peak_memory_gib(self) -> list[float]:
        return [stage.total / GIB for stage in self.memory]

    @property
    def fits(self) -> bool:
        return all(m.total <= b for m, b in zip(self.memory, self.memory_budget_bytes, strict=True))

    def to_dict(self) -> dict[str, Any]:
        return {
            **{name: getattr(self, name) for name in (
                "step_time_s", "tokens_per_s", "tflops_per_gpu", "model_tflops_per_gpu", "mfu",
                "bubble_fraction", "peak_memory_gib")},
            "memory_budget_gib": [b / GIB for b in self.memory_budget_bytes],
            "fits": self.fits,
            "breakdown_s": dict(self.breakdown_s),
            "memory_breakdown_gib": [
                {k: (v / GIB if k != "in_flight_microbatches" else v) for k, v in asdict(m).items()}
                for m in self.memory
            ],
            "stage_times_s": [list(t) for t in self.stage_times_s],
        }
