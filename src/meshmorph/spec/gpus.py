"""GPU catalog: dense peak FLOP/s per dtype, memory, HBM bandwidth and default links.

Figures are the vendors' data-sheet numbers for the SXM/OAM part where one exists, always the
dense figure (NVIDIA quotes tensor-core throughput "with sparsity" at exactly 2x dense; never use
that). K80 is one of the two GPUs on a K80 board. ``cpu`` is a stand-in for local CPU processes
so that the demo can plan for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkSpec:
    """A link class, as seen by one GPU: bandwidth per direction and latency."""

    name: str
    """Link technology (``nvlink3``, ``ib-hdr``, ...)."""
    bandwidth_gbps: float
    """GB/s per GPU per direction, nominal."""
    latency_us: float
    """One-way latency of a small message, microseconds."""


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

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for a training dtype; falls back to the next wider dtype."""
        for candidate in (dtype, {"bf16": "fp16", "fp16": "bf16", "fp8": "bf16"}.get(dtype, "fp32"), "fp32"):
            if candidate in self.peak_tflops:
                return self.peak_tflops[candidate] * 1e12
        raise KeyError(f"{self.name} has no peak figure for {dtype}")

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * 2**30


GPU_CATALOG: dict[str, GPUSpec] = {
    gpu.name: gpu
    for gpu in (
        GPUSpec(name="k80", description="NVIDIA Tesla K80 (one GK210 of two)", memory_gib=12,
                hbm_gbps=240, peak_tflops={"fp32": 4.37, "fp16": 4.37},
                intra_node_link="pcie3", inter_node_link="eth-25g", price_per_hour=0.45),
        GPUSpec(name="p100", description="NVIDIA Tesla P100 SXM2 16GB", memory_gib=16, hbm_gbps=732,
                peak_tflops={"fp32": 10.6, "fp16": 21.2}, intra_node_link="nvlink1",
                inter_node_link="ib-edr", price_per_hour=1.46),
        GPUSpec(name="v100-16g", description="NVIDIA Tesla V100 SXM2 16GB", memory_gib=16,
                hbm_gbps=900, peak_tflops={"fp32": 15.7, "fp16": 125.0},
                intra_node_link="nvlink2", inter_node_link="ib-edr", price_per_hour=2.48),
        GPUSpec(name="v100-32g", description="NVIDIA Tesla V100 SXM2 32GB", memory_gib=32,
                hbm_gbps=900, peak_tflops={"fp32": 15.7, "fp16": 125.0},
                intra_node_link="nvlink2", inter_node_link="ib-edr", price_per_hour=3.06),
        GPUSpec(name="t4", description="NVIDIA T4", memory_gib=16, hbm_gbps=320,
                peak_tflops={"fp32": 8.1, "fp16": 65.0}, intra_node_link="pcie3",
                inter_node_link="eth-100g", price_per_hour=0.35),
        GPUSpec(name="a10", description="NVIDIA A10", memory_gib=24, hbm_gbps=600,
                peak_tflops={"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0},
                intra_node_link="pcie4", inter_node_link="eth-100g", price_per_hour=1.00),
        GPUSpec(name="l4", description="NVIDIA L4", memory_gib=24, hbm_gbps=300,
                peak_tflops={"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0, "fp8": 242.5},
                intra_node_link="pcie4", inter_node_link="eth-100g", price_per_hour=0.80),
        GPUSpec(name="a100-40g", description="NVIDIA A100 SXM4 40GB", memory_gib=40, hbm_gbps=1555,
                peak_tflops={"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
                intra_node_link="nvlink3", inter_node_link="ib-hdr", price_per_hour=3.67),
        GPUSpec(name="a100-80g", description="NVIDIA A100 SXM4 80GB", memory_gib=80, hbm_gbps=2039,
                peak_tflops={"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
                intra_node_link="nvlink3", inter_node_link="ib-hdr", price_per_hour=4.10),
        GPUSpec(name="h100", description="NVIDIA H100 SXM5 80GB", memory_gib=80, hbm_gbps=3350,
                peak_tflops={"fp32": 67.0, "tf32": 494.5, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9},
                intra_node_link="nvlink4", inter_node_link="ib-ndr", price_per_hour=6.98),
        GPUSpec(name="h200", description="NVIDIA H200 SXM 141GB", memory_gib=141, hbm_gbps=4800,
                peak_tflops={"fp32": 67.0, "tf32": 494.5, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9},
                intra_node_link="nvlink4", inter_node_link="ib-ndr", price_per_hour=8.50),
        GPUSpec(name="mi300x", description="AMD Instinct MI300X", memory_gib=192, hbm_gbps=5300,
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
        raise ValueError(
            f"unknown GPU {name!r}; known: {', '.join(GPU_CATALOG)}"
        ) from None


def link(name: str) -> LinkSpec:
    try:
        return LINKS[name]
    except KeyError:
        raise ValueError(f"unknown link {name!r}; known: {', '.join(LINKS)}") from None
