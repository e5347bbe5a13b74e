"""The job file (``job.toml``): what to train, on which data, for how long, and where to write.

Relative paths: ``[data] path`` is read relative to the job file's folder, ``[run] out_dir``
relative to the working directory, ``[checkpoint] dir`` relative to ``out_dir``.
"""

from __future__ import annotations

import math
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from meshmorph.files import read_document
from meshmorph.run.config import OptimConfig, check_steps
from meshmorph.spec.plan import DType, Fp8Scaling


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSection:
    """``[model]``: the model to build."""

    source: str
    """Catalog name (``gpt-tiny``), Hugging Face ``config.json`` path, or ``package.module:function``."""
    seq_len: int
    """Tokens per training sequence."""

    def __post_init__(self) -> None:
        if self.seq_len < 1:
            raise ValueError(f"[model] seq_len must be at least 1, got {self.seq_len}")


@dataclass(frozen=True, slots=True, kw_only=True)
class DataSection:
    """``[data]``: where samples come from."""

    kind: str = "synthetic"
    """``synthetic`` (a learnable random token rule) or ``text`` (a file read as bytes)."""
    path: str | None = None
    """Text file for ``kind = "text"``, relative to the job file."""
    seed: int = 0
    """Seed of the sample order (and of the synthetic samples)."""

    def __post_init__(self) -> None:
        if self.kind not in ("synthetic", "text"):
            raise ValueError(f"[data] kind must be 'synthetic' or 'text', got {self.kind!r}")
        if self.kind == "text" and not self.path:
            raise ValueError("[data] kind = 'text' needs a path to a text file")
        if self.seed < 0:  # numpy's generators, which order and make the samples, take no other
            raise ValueError(f"[data] seed must be 0 or more, got {self.seed}")


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainSection:
    """``[train]``: the length and batch of the run."""

    steps: int
    """Optimizer steps to train (a resumed run stops at the same step count)."""
    global_batch: int
    """Sequences per optimizer step, over all data-parallel ranks."""
    micro_batch: int = 1
    """Sequences per micro-batch on one data-parallel rank (used by the default plan)."""
    seed: int = 0
    """Seed of the model initialisation."""
    dtype: str = "fp32"
    """Training dtype of the default and searched plans (``fp32``, ``bf16``, ``fp16``, or
    ``fp8``: bf16 whose transformer blocks' linear layers multiply in float8, torchao's float8
    training, run/model/float8.py)."""
    fp8_scaling: str = "tensorwise"
    """With dtype ``fp8``: the float8 scaling recipe of the default plan (``tensorwise``,
    ``rowwise`` or ``rowwise_with_gw_hp``: ``Plan.fp8_scaling``)."""
    compile: bool = False
    """Compile each transformer block with ``torch.compile`` (run/parallel/compile.py): sets the
    run's ``Plan.compile``, which also compiles where this is false."""
    compile_backend: str = "inductor"
    """``torch.compile`` backend: ``inductor``, ``aot_eager`` or ``eager`` (inductor on a CPU
    without a C++ compiler falls back to aot_eager and says so)."""

    def __post_init__(self) -> None:
        for name in ("steps", "global_batch", "micro_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"[train] {name} must be at least 1, got {getattr(self, name)}")
        check_steps("[train] steps", self.steps)
        if self.global_batch % self.micro_batch:
            raise ValueError(
                f"[train] micro_batch {self.micro_batch} does not divide global_batch "
                f"{self.global_batch}"
            )
        if self.dtype not in tuple(DType):
            raise ValueError(f"[train] dtype must be fp32, bf16, fp16 or fp8, got {self.dtype!r}")
        if self.fp8_scaling not in tuple(Fp8Scaling):
            raise ValueError(f"[train] fp8_scaling must be one of {', '.join(Fp8Scaling)}, got "
                             f"{self.fp8_scaling!r}")
        if self.fp8_scaling != Fp8Scaling.TENSORWISE and self.dtype != DType.FP8:
            raise ValueError(f"[train] fp8_scaling {self.fp8_scaling!r} applies to dtype fp8, "
                             f"not {self.dtype!r}; set dtype = \"fp8\" or leave fp8_scaling out")
        if self.compile_backend not in ("inductor", "aot_eager", "eager"):
            raise ValueError(f"[train] compile_backend must be inductor, aot_eager or eager, got "
                             f"{self.compile_backend!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointSection:
    """``[checkpoint]``: how often to save and how many to keep."""

    every: int = 0
    """Save every this many steps (0: never)."""
    keep: int = 2
    """Newest complete checkpoints to keep; older ones are deleted."""
    dir: str = "checkpoints"
    """Checkpoint folder, relative to the run folder."""

    def __post_init__(self) -> None:
        if self.every < 0 or self.keep < 1:
            raise ValueError(
                f"[checkpoint] needs every >= 0 and keep >= 1, got every {self.every}, "
                f"keep {self.keep}"
            )
        folder = Path(self.dir)
        if not self.dir or folder.is_absolute() or ".." in folder.parts or folder == Path("."):
            raise ValueError(
                f"[checkpoint] dir must be a folder inside the run folder (a relative path "
                f"without '..'), got {self.dir!r}; leave it out for 'checkpoints'"
            )


MAX_COLLECTIVE_TIMEOUT_S = 86400.0
"""The longest ``[run] collective_timeout_s``: a day (longer is a hang, and a figure such as 1e300
overflows the ranks' timeout)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSection:
    """``[run]``: where the run writes."""

    out_dir: str = "runs/job"
    """Run folder (metrics.jsonl, loss.png, plan.json, checkpoints/)."""
    collective_timeout_s: float = 120.0
    """Longest a rank waits in one collective (a barrier, a gradient reduction) before it stops
    with an error naming itself, instead of hanging when another rank died."""

    def __post_init__(self) -> None:
        if not self.out_dir:
            raise ValueError("[run] out_dir must name a folder, got an empty string")
        if not math.isfinite(self.collective_timeout_s) or self.collective_timeout_s <= 0:
            raise ValueError(
                f"[run] collective_timeout_s must be a positive number of seconds, got "
                f"{self.collective_timeout_s}"
            )
        if self.collective_timeout_s > MAX_COLLECTIVE_TIMEOUT_S:
            raise ValueError(
                f"[run] collective_timeout_s = {self.collective_timeout_s:g} is above "
                f"{MAX_COLLECTIVE_TIMEOUT_S:,.0f} s (a day): a collective waiting that long is a "
                "hang, not a slow step; give seconds, e.g. 600, or leave it out (120)"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class JobConfig:
    """One training job, as read from a job file."""

    model: ModelSection
    """What to train."""
    data: DataSection = field(default_factory=DataSection)
    """Where samples come from."""
    train: TrainSection
    """How long and how big a batch."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """AdamW and its learning-rate schedule."""
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    """Checkpoint frequency and retention."""
    run: RunSection = field(default_factory=RunSection)
    """Output folder."""
    base_dir: Path = Path(".")
    """Folder relative data paths are read from (the job file's folder)."""

    def data_path(self) -> Path | None:
        if self.data.path is None:
            return None
        path = Path(self.data.path)
        return path if path.is_absolute() else self.base_dir / path

    def out_dir(self) -> Path:
        return Path(self.run.out_dir)

    def checkpoint_dir(self, out_dir: Path | None = None) -> Path:
        return (out_dir or self.out_dir()) / self.checkpoint.dir


_SECTIONS: dict[str, type] = {
    "model": ModelSection, "data": DataSection, "train": TrainSection, "optim": OptimConfig,
    "checkpoint": CheckpointSection, "run": RunSection,
}
_REQUIRED = ("model", "train")


def _accepts(annotation: Any, value: Any) -> bool:
    """Whether a TOML value fits a field annotation (``int`` also takes no bool; ``float``
    also takes an int)."""
    hint = eval(annotation, {"Path": Path}) if isinstance(annotation, str) else annotation
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    for option in options:
        if option is type(None) and value is None:
            return True
        if option is bool and isinstance(value, bool):
            return True
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return True
        if option is float and isinstance(value, int | float) and not isinstance(value, bool):
            return True
        if option is str and isinstance(value, str):
            return True
    return False


def _section(name: str, cls: type, data: Any, source: str) -> Any:
    if not isinstance(data, dict):
        raise ValueError(f"{source}: [{name}] must be a table, got {type(data).__name__}")
    known = {f.name: f for f in fields(cls)}
    for key, value in data.items():
        if key not in known:
            raise ValueError(
                f"{source}: unknown key '{key}' in [{name}]; known keys: {', '.join(known)}"
            )
        if not _accepts(known[key].type, value):
            raise ValueError(
                f"{source}: [{name}] {key} must be {known[key].type}, got {value!r}"
            )
    kwargs = {k: float(v) if known[k].type in ("float", "float | None") and v is not None
              else v for k, v in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required key is missing
        raise ValueError(f"{source}: [{name}] is incomplete: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


def parse_job(data: dict[str, Any], *, source: str = "job", base_dir: Path = Path(".")) -> JobConfig:
    """A JobConfig from parsed TOML; ``source`` names the file in error messages."""
    for name in data:
        if name not in _SECTIONS:
            raise ValueError(
                f"{source}: unknown section [{name}]; known sections: {', '.join(_SECTIONS)}"
            )
    for name in _REQUIRED:
        if name not in data:
            raise ValueError(f"{source}: missing section [{name}]")
    sections = {name: _section(name, cls, data[name], source)
                for name, cls in _SECTIONS.items() if name in data}
    return JobConfig(**sections, base_dir=base_dir)


def load_job(path: str | Path) -> JobConfig:
    """Read and check a job file; every error names the file and the key."""
    path = Path(path)
    data = read_document(path, what="job file", fmt="toml",
                         way_out="pass a valid job TOML (examples/jobs/ holds some to start "
                                 "from)")
    return parse_job(data, source=str(path), base_dir=path.parent)
