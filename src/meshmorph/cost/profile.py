"""Profile: measured figures that replace the catalog's guesses (made by profile/ on real GPUs)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path


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

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"profile file {path} does not exist")
        data = json.loads(path.read_text())
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"profile {path} has unknown keys {sorted(unknown)}; known: {sorted(known)}")
        return cls(**data)
