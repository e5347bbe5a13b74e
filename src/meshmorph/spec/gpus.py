"""GPU catalog: dense peak FLOP/s per dtype, memory, HBM bandwidth and default links.

Figures are the vendors' data-sheet numbers for the SXM/OAM part where one exists, always the
dense figure (NVIDIA quotes tensor-core throughput "with sparsity" at exactly 2x dense; never use
that). K80 is one of the two GPUs on a K80 board. ``cpu`` is a stand-in for local CPU processes
so that the demo can plan for them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from meshmorph.files import read_document

BOUNDS: dict[str, tuple[float, str, str]] = {
    "memory_gib": (1e6, "GiB", "the largest devices hold a few hundred GiB"),
    "hbm_gbps": (1e8, "GB/s", "5 times a wafer-scale chip's on-chip bandwidth"),
    "peak_tflops": (1e7, "TFLOP/s", "80 times a wafer-scale chip's peak"),
    "sm_count": (1e7, "cores", "10 times a wafer-scale chip's cores"),
    "bandwidth_gbps": (1e7, "GB/s", "10,000 times NVLink 5 per GPU"),
    "latency_us": (1e6, "us", "a second for a small message"),
}
"""Plausibility bounds of the figures a GPU or link takes: (limit, unit, what the limit is
against). No hardware comes near them; a figure above one is a typo (a unit slip, a missing
decimal point) that would make every estimate wrong, so it is refused (``check_bound``)."""


def check_bound(owner: str, key: str, value: float) -> None:
    """Refuse ``value`` of ``key`` (a ``BOUNDS`` key, or ``peak_tflops.DTYPE``) above its bound."""
    limit, unit, against = BOUNDS[key.split(".")[0]]
    if value > limit:
        raise ValueError(f"{owner}: {key} = {value:g} is above {limit:,.0f} {unit}, far beyond "
                         f"any hardware ({against}); give the data-sheet figure in {unit}")


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkSpec:
    """A link class, as seen by one GPU: bandwidth per direction and latency."""

    name: str
    """Link technology (``nvlink3``, ``ib-hdr``, ...)."""
    bandwidth_gbps: float
    """GB/s per GPU per direction, nominal."""
    latency_us: float
    """One-way latency of a small message, microseconds."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.bandwidth_gbps) and self.bandwidth_gbps > 0):
            raise ValueError(f"link {self.name!r}: bandwidth_gbps must be a finite number > 0, "
                             f"got {self.bandwidth_gbps!r}; give its GB/s per GPU per direction")
        if not (math.isfinite(self.latency_us) and self.latency_us >= 0):
            raise ValueError(f"link {self.name!r}: latency_us must be a finite number >= 0, got "
                             f"{self.latency_us!r}")
        for key in ("bandwidth_gbps", "latency_us"):
            check_bound(f"link {self.name!r}", key, getattr(self, key))


LINKS: dict[str, LinkSpec] = {
    link.name: link
    for link in (
        LinkSpec(name="pcie3", bandwidth_gbps=12.0, latency_us=10.0),
        LinkSpec(name="pcie4", bandwidth_gbps=24.0, latency_us=8.0),
        LinkSpec(name="pcie5", bandwidth_gbps=48.0, latency_us=8.0),
        LinkSpec(name="nvlink1", bandwidth_gbps=80.0, latency_us=5.0),  # P100: 4 x 20 GB/s
        LinkSpec(name="nvlink2", bandwidth_gbps=150.0, latency_us=5.0),  # V100: 6 x 25 GB/s
        LinkSpec(name="nvlink3", bandwidth_gbps=300.0, latency_us=5.0),  # A100: 12 x 25 GB/s
        LinkSpec(name="nvlink4", bandwidth_gbps=450.0, latency_us=4.0),  # H100/H200: 18 x 25 GB/s
        LinkSpec(name="xgmi3", bandwidth_gbps=448.0, latency_us=5.0),  # MI300X: 7 x 64 GB/s
        LinkSpec(name="eth-25g", bandwidth_gbps=25 / 8 / 8, latency_us=30.0),  # one 25 Gb/s NIC per 8 GPUs
        LinkSpec(name="eth-100g", bandwidth_gbps=100 / 8 / 8, latency_us=20.0),
        LinkSpec(name="ib-edr", bandwidth_gbps=100 / 8, latency_us=5.0),  # one 100 Gb/s HCA per GPU
        LinkSpec(name="ib-hdr", bandwidth_gbps=200 / 8, latency_us=5.0),  # one 200 Gb/s HCA per GPU
        LinkSpec(name="ib-ndr", bandwidth_gbps=400 / 8, latency_us=5.0),  # one 400 Gb/s HCA per GPU
        LinkSpec(name="loopback", bandwidth_gbps=2.0, latency_us=50.0),  # gloo between CPU processes
    )
}


@dataclass(frozen=True, slots=True, kw_only=True)
class GPUSpec:
    """One accelerator type."""

    name: str
    """Catalog key (``a100-80g``)."""
    description: str
    """Part name as sold."""
    memory_gib: float
    """Device memory, GiB."""
    hbm_gbps: float
    """Memory bandwidth, GB/s."""
    peak_tflops: dict[str, float] = field(default_factory=dict)
    """Dense peak TFLOP/s per dtype: ``fp32``, ``tf32``, ``bf16``, ``fp16``, ``fp8``."""
    intra_node_link: str = "pcie4"
    """Default link between GPUs of one node (a LINKS key)."""
    inter_node_link: str = "ib-hdr"
    """Default link between nodes (a LINKS key)."""
    price_per_hour: float | None = None
    """Typical on-demand cloud price per GPU-hour, USD (None: not rented)."""
    spot_price_per_hour: float | None = None
    """Spot/preemptible price per GPU-hour, USD (None: no dated figure in the catalog)."""
    price_date: str | None = None
    """When the prices were read (``2017-12``); None: an undated typical list price."""
    price_source: str = ""
    """Where the prices come from."""
    sm_count: float = 0
    """Streaming multiprocessors (AMD: compute units) that run GEMM tiles in waves; 0: unknown
    (no wave quantisation). Vendor data sheets / architecture whitepapers."""

    def __post_init__(self) -> None:
        for key in ("memory_gib", "hbm_gbps"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"GPU {self.name!r}: {key} must be a finite number > 0, got "
                                 f"{value!r}; give the part's data-sheet figure")
            check_bound(f"GPU {self.name!r}", key, value)
        if not self.peak_tflops:
            raise ValueError(f"GPU {self.name!r} lists no peak_tflops; give at least one dtype, "
                             "e.g. { bf16 = 989.4 }")
        for dtype, value in self.peak_tflops.items():
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"GPU {self.name!r}: peak_tflops.{dtype} must be a finite number "
                                 f"> 0, got {value!r}; leave out a dtype the part does not run")
            check_bound(f"GPU {self.name!r}", f"peak_tflops.{dtype}", value)
        if not (math.isfinite(self.sm_count) and self.sm_count >= 0):
            raise ValueError(f"GPU {self.name!r}: sm_count must be >= 0 (0: unknown), got "
                             f"{self.sm_count!r}")
        check_bound(f"GPU {self.name!r}", "sm_count", self.sm_count)

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for a training dtype; a 16-bit dtype falls back to the other 16-bit
        one, then to fp32. fp8 has no fallback: a GPU without float8 tensor cores cannot run a
        float8 GEMM at any rate (ValueError naming a way out)."""
        if dtype == "fp8" and "fp8" not in self.peak_tflops:
            with_fp8 = ", ".join(name for name, gpu in GPU_CATALOG.items()
                                 if "fp8" in gpu.peak_tflops)
            raise ValueError(f"GPU {self.name!r} has no float8 tensor cores (its peak_tflops "
                             f"lists no fp8): train it in bf16 (--dtype bf16), or on a GPU with "
                             f"fp8 ({with_fp8})")
        for candidate in (dtype, {"bf16": "fp16", "fp16": "bf16"}.get(dtype, "fp32"), "fp32"):
            if candidate in self.peak_tflops:
                return self.peak_tflops[candidate] * 1e12
        raise KeyError(f"{self.name} has no peak figure for {dtype}")

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * 2**30


_GCP_2017 = {"price_date": "2017-12",
             "price_source": "GCP launch list price of an attached GPU (transient-cloud reference)"}
_V100 = GPUSpec(name="v100-16g", sm_count=80, description="NVIDIA Tesla V100 SXM2 16GB", memory_gib=16,
                hbm_gbps=900, peak_tflops={"fp32": 15.7, "fp16": 125.0},
                intra_node_link="nvlink2", inter_node_link="ib-edr", price_per_hour=2.48)
_A100 = GPUSpec(name="a100-40g", sm_count=108, description="NVIDIA A100 SXM4 40GB", memory_gib=40, hbm_gbps=1555,
                peak_tflops={"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
                intra_node_link="nvlink3", inter_node_link="ib-hdr", price_per_hour=3.67)
_H100 = GPUSpec(name="h100", sm_count=132, description="NVIDIA H100 SXM5 80GB", memory_gib=80, hbm_gbps=3350,
                peak_tflops={"fp32": 67.0, "tf32": 494.5, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9},
                intra_node_link="nvlink4", inter_node_link="ib-ndr", price_per_hour=6.98)

GPU_CATALOG: dict[str, GPUSpec] = {
    gpu.name: gpu
    for gpu in (
        GPUSpec(name="k80", sm_count=13, description="NVIDIA Tesla K80 (one GK210 of two)", memory_gib=12,
                hbm_gbps=240, peak_tflops={"fp32": 4.37, "fp16": 4.37}, intra_node_link="pcie3",
                inter_node_link="eth-25g", price_per_hour=0.44, spot_price_per_hour=0.22, **_GCP_2017),
        GPUSpec(name="p100", sm_count=56, description="NVIDIA Tesla P100 SXM2 16GB", memory_gib=16, hbm_gbps=732,
                peak_tflops={"fp32": 10.6, "fp16": 21.2}, intra_node_link="nvlink1",
                inter_node_link="ib-edr", price_per_hour=1.46, spot_price_per_hour=0.73, **_GCP_2017),
        _V100,
        replace(_V100, name="v100-32g", description="NVIDIA Tesla V100 SXM2 32GB", memory_gib=32, price_per_hour=3.06),
        GPUSpec(name="t4", sm_count=40, description="NVIDIA T4", memory_gib=16, hbm_gbps=320,
                peak_tflops={"fp32": 8.1, "fp16": 65.0}, intra_node_link="pcie3",
                inter_node_link="eth-100g", price_per_hour=0.35),
        GPUSpec(name="a10", sm_count=72, description="NVIDIA A10", memory_gib=24, hbm_gbps=600,
                peak_tflops={"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0},
                intra_node_link="pcie4", inter_node_link="eth-100g", price_per_hour=1.00),
        GPUSpec(name="l4", sm_count=58, description="NVIDIA L4", memory_gib=24, hbm_gbps=300,
                peak_tflops={"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0, "fp8": 242.5},
                intra_node_link="pcie4", inter_node_link="eth-100g", price_per_hour=0.80),
        _A100,
        replace(_A100, name="a100-80g", description="NVIDIA A100 SXM4 80GB", memory_gib=80, hbm_gbps=2039,
                price_per_hour=4.10),
        _H100,  # the H200: an H100 with more and faster memory
        replace(_H100, name="h200", description="NVIDIA H200 SXM 141GB", memory_gib=141, hbm_gbps=4800,
                price_per_hour=8.50),
        GPUSpec(name="mi300x", sm_count=304, description="AMD Instinct MI300X", memory_gib=192, hbm_gbps=5300,
                peak_tflops={"fp32": 163.4, "tf32": 653.7, "bf16": 1307.4, "fp16": 1307.4, "fp8": 2614.9},
                intra_node_link="xgmi3", inter_node_link="ib-ndr", price_per_hour=6.00),
        GPUSpec(name="cpu", description="one local CPU process (fp32, gloo)", memory_gib=4,
                hbm_gbps=20, peak_tflops={"fp32": 0.05}, intra_node_link="loopback",
                inter_node_link="loopback"),
    )
}


def gpu(name: str) -> GPUSpec:
    try:
        return GPU_CATALOG[name.lower()]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPU_CATALOG)}") from None


def link(name: str) -> LinkSpec:
    try:
        return LINKS[name]
    except KeyError:
        raise ValueError(f"unknown link {name!r}; known: {', '.join(LINKS)}") from None


# --- user GPUs and links in TOML -----------------------------------------------------------------
# [links.roce-200g]            # a new link class (or new figures for a known one)
# bandwidth_gbps = 25
# latency_us = 6
# [gpus.h100]                  # a known GPU: only the keys given change (here: dated prices)
# price_per_hour = 6.98
# spot_price_per_hour = 2.5
# price_date = "2026-11"
# [gpus.my-accel]              # a new GPU: memory_gib, hbm_gbps and peak_tflops are required
# memory_gib = 96
# hbm_gbps = 4000
# peak_tflops = { bf16 = 800, fp32 = 60 }
_GPU_KEYS = tuple(f.name for f in fields(GPUSpec) if f.name != "name")
_NEW_GPU_REQUIRED = ("memory_gib", "hbm_gbps", "peak_tflops")


def is_figure(value: object, *, zero_ok: bool = True) -> bool:
    """Whether ``value`` is a finite number (a bool is none) >= 0, or > 0 without ``zero_ok``."""
    return isinstance(value, int | float) and not isinstance(value, bool) \
        and math.isfinite(value) and (value >= 0 if zero_ok else value > 0)


def _toml_number(value: Any, key: str, where: str) -> float:
    if not is_figure(value):
        raise ValueError(f"{where}: {key} must be a number >= 0, got {value!r}")
    return float(value)


def _toml_gpu(name: str, entry: Any, base: GPUSpec | None, links: dict[str, LinkSpec],
              where: str) -> GPUSpec:
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: [gpus.{name}] must be a table, got {entry!r}")
    unknown = [k for k in entry if k not in _GPU_KEYS]
    if unknown:
        raise ValueError(f"{where}: unknown key {', '.join(map(repr, unknown))} in [gpus.{name}]; "
                         f"valid keys: {', '.join(_GPU_KEYS)}")
    if base is None:
        missing = [k for k in _NEW_GPU_REQUIRED if k not in entry]
        if missing:
            raise ValueError(f"{where}: new GPU {name!r} needs {', '.join(missing)} (or name a "
                             f"catalog GPU to change: {', '.join(GPU_CATALOG)})")
    changes: dict[str, Any] = {}
    for key, value in entry.items():
        if key in ("description", "price_date", "price_source", "intra_node_link",
                   "inter_node_link"):
            if not isinstance(value, str):
                raise ValueError(f"{where}: {key} in [gpus.{name}] must be a string, got {value!r}")
            if key.endswith("_link") and value not in links:
                raise ValueError(f"{where}: unknown {key} {value!r} in [gpus.{name}]; valid links: "
                                 f"{', '.join(links)} (or define it under [links.NAME])")
            changes[key] = value
        elif key == "peak_tflops":
            if not isinstance(value, dict) or not value:
                raise ValueError(f"{where}: peak_tflops in [gpus.{name}] must be a table such as "
                                 "{ bf16 = 989.4, fp32 = 67 }")
            changes[key] = {d: _toml_number(v, f"peak_tflops.{d}", where) for d, v in value.items()}
        else:
            changes[key] = _toml_number(value, key, where)
    if base is None:
        return GPUSpec(name=name, description=changes.pop("description", name), **changes)
    return replace(base, **changes)


def gpus_from_toml(data: dict[str, Any], where: str) -> tuple[dict[str, GPUSpec], dict[str, LinkSpec]]:
    """The GPUs and links a TOML document's ``[gpus.*]`` and ``[links.*]`` tables define, each
    merged over the catalog entry of the same name (format in the comment above)."""
    for table in ("gpus", "links"):
        if not isinstance(data.get(table, {}), dict):
            raise ValueError(f"{where}: {table} must be a table of [{table}.NAME] tables, got "
                             f"{data[table]!r}")
    links = dict(LINKS)
    for name, entry in (data.get("links") or {}).items():
        if not isinstance(entry, dict) or set(entry) - {"bandwidth_gbps", "latency_us"}:
            raise ValueError(f"{where}: [links.{name}] takes bandwidth_gbps and latency_us only")
        base = LINKS.get(name)
        if base is None and set(entry) != {"bandwidth_gbps", "latency_us"}:
            raise ValueError(f"{where}: new link {name!r} needs bandwidth_gbps and latency_us")
        figures = {k: _toml_number(v, k, where) for k, v in entry.items()}
        links[name] = replace(base, **figures) if base else LinkSpec(name=name, **figures)
    gpus = {}
    for name, entry in (data.get("gpus") or {}).items():
        key = name.lower()
        gpus[key] = _toml_gpu(key, entry, GPU_CATALOG.get(key), links, where)
    return gpus, links


def load_gpus_toml(path: Path | str) -> dict[str, GPUSpec]:
    """Add or override catalog GPUs (and links) from a TOML file, for this process; returns the
    entries the file defined."""
    path = Path(path)
    data = read_document(path, what="GPU file", fmt="toml",
                         way_out="pass a .toml file with [gpus.NAME] and [links.NAME] tables")
    unknown = [k for k in data if k not in ("gpus", "links")]
    if unknown:
        raise ValueError(f"{path}: unknown table {', '.join(map(repr, unknown))}; a GPU file holds "
                         "[gpus.NAME] and [links.NAME] tables")
    if not data:
        raise ValueError(f"GPU file {path} defines no GPU or link; add [gpus.NAME] or "
                         "[links.NAME] tables, or leave out --gpus")
    gpus, links = gpus_from_toml(data, str(path))
    LINKS.update(links)
    GPU_CATALOG.update(gpus)
    return gpus


def flops_dtype(dtype: str) -> str:
    """The dtype whose peak prices a plan's FLOPs outside float8 GEMMs and defines its MFU: bf16
    for ``fp8`` (its attention, head and elementwise work run in bf16; torchtitan reports fp8
    runs' MFU against the bf16 peak), the dtype itself otherwise."""
    return "bf16" if dtype == "fp8" else dtype
