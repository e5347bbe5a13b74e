"""Profile: measured figures that replace the catalog's guesses (made by ``meshmorph profile``).

Everything is optional: the cost model uses a measured figure where one exists for what it prices
and the catalog's defaults otherwise. Layer times are keyed by model, sequence length, micro-batch
size, dtype and layer index (``layer_key``) and were measured on one tensor-parallel rank with
``processes`` processes running the same work at once on ``cores`` cores, so that processes
beyond the core count share cores in the figures themselves (contention is measured, not assumed).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from meshmorph.files import read_document
from meshmorph.spec.gpus import is_figure


def layer_key(model: str, seq_len: int, micro_batch: int, dtype: str, index: int) -> str:
    """The key of one layer's measured times: ``gpt-small/s64/b2/fp32/L3``."""
    return f"{model}/s{seq_len}/b{micro_batch}/{dtype}/L{index}"


@dataclass(frozen=True, slots=True)
class LayerTime:
    """Measured forward and backward time of one layer for one micro-batch shape."""

    fwd_s: float
    """Median forward seconds (one tensor-parallel rank, tp = 1)."""
    bwd_s: float
    """Median backward seconds (input and weight gradients)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Profile:
    """Measured coefficients; every field is optional and overrides the default where given."""

    matmul_efficiency: dict[str, float] = field(default_factory=dict)
    """GPU name -> achieved fraction of dense peak for large GEMMs."""
    link_bandwidth_gbps: dict[str, float] = field(default_factory=dict)
    """Link name -> achieved GB/s per rank (bus bandwidth as nccl-tests reports it)."""
    link_latency_us: dict[str, float] = field(default_factory=dict)
    """Link name -> measured small-message latency, microseconds."""
    source: str = ""
    """Where and when the profile was measured."""
    gemm_flops_per_s: dict[str, float] = field(default_factory=dict)
    """``dtype:MxNxK`` -> achieved FLOP/s of that GEMM (2 M N K FLOPs per call)."""
    collectives: dict[str, dict[str, float]] = field(default_factory=dict)
    """``kind/group_size`` (all_reduce, all_gather, reduce_scatter, send_recv) -> the fitted
    ``alpha_s`` (seconds per call), ``beta_s_per_byte`` and ``r2`` of time = alpha + beta * bytes."""
    layer_times: dict[str, dict[str, float]] = field(default_factory=dict)
    """``layer_key(...)`` -> ``fwd_s``, ``bwd_s`` (see LayerTime) and ``spread``, the relative
    half-width of the repeats' inter-quartile range, (q75 - q25) / 2 / median."""
    optimizer_s_per_param: float = 0.0
    """Seconds per parameter of the step's tail (gradient norm, clip, AdamW, zero_grad); 0: use
    the catalog's HBM-bandwidth estimate."""
    optimizer_fixed_s: float = 0.0
    """Seconds per step of the tail that do not grow with the parameter count (Python and
    per-tensor overhead), fitted beside ``optimizer_s_per_param``."""
    processes: int = 1
    """Processes that ran the measurements at the same time (the contention they include)."""
    cores: int = 0
    """CPU cores of the machine that measured (0: unknown)."""
    load_avg: float = 0.0
    """The 1-minute load average when the measurements ended."""

    def layer_time(self, model: str, seq_len: int, micro_batch: int, dtype: str,
                   index: int) -> LayerTime | None:
        """The measured time of a layer, or None where this shape was not profiled."""
        row = self.layer_times.get(layer_key(model, seq_len, micro_batch, dtype, index))
        if row is None:
            return None
        return LayerTime(row["fwd_s"], row["bwd_s"])

    def collective_s(self, kind: str, group_size: int, nbytes: float) -> float | None:
        """Measured seconds of one collective (alpha + beta * bytes, comm.py's M), or None where
        this kind and group size were not profiled."""
        row = self.collectives.get(f"{kind}/{group_size}")
        if row is None or nbytes <= 0 or group_size <= 1:
            return None
        return row["alpha_s"] + row["beta_s_per_byte"] * nbytes

    def oversubscribed(self) -> bool:
        """Whether the profiled processes filled every core: then no core is left to run a
        collective beside compute, so no communication overlaps (CPU processes)."""
        return self.cores > 0 and self.processes >= self.cores

    def covers(self, model: str, seq_len: int, micro_batch: int, dtype: str,
               num_layers: int) -> bool:
        """Whether every layer of this model and micro-batch shape was profiled."""
        return all(self.layer_time(model, seq_len, micro_batch, dtype, i) is not None
                   for i in range(num_layers))

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n")

    @classmethod
    def from_dict(cls, data: dict[str, object], where: str = "profile") -> Profile:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"{where} has unknown keys {sorted(unknown)}; known: {sorted(known)} "
                             "(re-run meshmorph profile with this version)")
        for key, value in data.items():
            _check_field(key, value, where)
        return cls(**data)  # type: ignore[arg-type]

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        data = read_document(path, what="profile file", fmt="json",
                             way_out="make one with meshmorph profile --out FILE")
        return cls.from_dict(data, f"profile {path}")


_FIGURES = {"matmul_efficiency": False, "link_bandwidth_gbps": False, "link_latency_us": True,
            "gemm_flops_per_s": False}
"""The name -> figure tables of a Profile, with whether a figure may be 0 (else it must be > 0)."""
_ROWS = {"collectives": {"alpha_s": True, "beta_s_per_byte": False},
         "layer_times": {"fwd_s": True, "bwd_s": True}}
"""The name -> row tables, with the figures each row needs (and whether each may be 0)."""
_SCALARS = {"optimizer_s_per_param": True, "optimizer_fixed_s": True, "load_avg": True}


def _check_field(key: str, value: object, where: str) -> None:
    """Refuse a Profile field of the wrong type, or a figure that is not finite or is negative
    (a zero bandwidth or efficiency would divide by zero in the cost model)."""
    fix = "re-run meshmorph profile or fix the file"

    def figure(name: str, number: object, zero_ok: bool) -> None:
        if not is_figure(number, zero_ok=zero_ok):
            bound = ">= 0" if zero_ok else "> 0"
            raise ValueError(f"{where}: {name} must be a finite number {bound}, got {number!r}; "
                             f"{fix}")

    if key == "source":
        if not isinstance(value, str):
            raise ValueError(f"{where}: source must be a string, got {value!r}; {fix}")
    elif key in ("processes", "cores"):
        lowest = 1 if key == "processes" else 0
        if not isinstance(value, int) or isinstance(value, bool) or value < lowest:
            raise ValueError(f"{where}: {key} must be a whole number >= {lowest}, got {value!r}; "
                             f"{fix}")
    elif key in _SCALARS:
        figure(key, value, _SCALARS[key])
    elif not isinstance(value, dict):
        raise ValueError(f"{where}: {key} must be a JSON object, got {value!r}; {fix}")
    elif key in _FIGURES:
        for name, number in value.items():
            figure(f"{key}[{name!r}]", number, _FIGURES[key])
    else:
        for name, row in value.items():
            if not isinstance(row, dict):
                raise ValueError(f"{where}: {key}[{name!r}] must be a JSON object, got {row!r}; "
                                 f"{fix}")
            for column, zero_ok in _ROWS[key].items():
                figure(f"{key}[{name!r}].{column}", row.get(column), zero_ok)
