"""The profiling job: what every rank measures, and the Profile rank 0 assembles from it."""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from meshmorph.cost.profile import Profile
from meshmorph.profile.alpha_beta import loopback_link
from meshmorph.profile.spawn import spawn
from meshmorph.run.launch.host_memory import host_memory_bytes
from meshmorph.spec.catalog import load_model
from meshmorph.spec.model import LayerKind, Recompute


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileConfig:
    """What ``meshmorph profile`` measures and how often."""

    nproc: int = 2
    """Processes measuring at once (one per GPU where GPUs exist); their contention is measured."""
    models: tuple[str, ...] = ("gpt-small",)
    """Catalog models whose layers are timed."""
    seq_len: int | None = None
    """Sequence length of the layer timings (None: each model's own)."""
    micro_batches: tuple[int, ...] = (1, 2, 4)
    """Micro-batch sizes of the layer timings."""
    dtypes: tuple[str, ...] = ("fp32",)
    """Training dtypes of the layer timings and GEMMs."""
    repeats: int = 7
    """Timed repeats of every measurement (after warm-up); medians and spreads come from them."""
    gemm_shapes: tuple[tuple[int, int, int], ...] = ((256, 256, 256), (512, 512, 512),
                                                     (1024, 1024, 1024), (512, 1024, 256))
    """(M, N, K) of the timed GEMMs."""
    message_bytes: tuple[int, ...] = (4096, 65536, 1 << 20, 4 << 20, 16 << 20)
    """Message sizes of the collective timings (bytes of comm.py's M)."""
    nice: int = 0
    """Priority increment of the measuring processes (negative, where privileged: ahead of other
    work sharing the cores, so the figures measure the hardware; the load is recorded either way)."""
    fsdp_unit_blocks: int = 3
    """FSDP2 units of 1..this many blocks of the first model are timed (profile/fsdp_units.py)."""

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ValueError(f"nproc must be at least 1, got {self.nproc}")
        if self.repeats < 3:
            raise ValueError(f"repeats must be at least 3 for a median and a spread, got {self.repeats}")

    def steps(self) -> int:
        """Measurements rank 0 reports, for the progress bar."""
        sizes = len(self.message_bytes)
        coll = sum((4 if g == 2 else 3) * sizes for g in range(2, self.nproc + 1))
        layers = len(self.models) * len(self.micro_batches) * len(self.dtypes)
        fsdp = self.fsdp_unit_blocks if self.nproc > 1 and self.models else 0
        return len(self.dtypes) + coll + fsdp + layers + len(self.models)


def quick_config(nproc: int, models: tuple[str, ...], seq_len: int | None) -> ProfileConfig:
    """Well under a minute: fewer repeats, shapes and sizes."""
    return ProfileConfig(nproc=nproc, models=models, seq_len=seq_len, repeats=3,
                         gemm_shapes=((512, 512, 512),), message_bytes=(4096, 1 << 20))


def _rank_job(rank: int, world: int, config: ProfileConfig, out_dir: str) -> None:
    import torch

    from meshmorph.profile.fsdp_units import fsdp_unit_fits
    from meshmorph.profile.hardware import collective_fits, gemm_flops
    from meshmorph.profile.layers import layer_times, optimizer_fit
    from meshmorph.spec.catalog import catalog_model

    device = torch.device(f"cuda:{rank % torch.cuda.device_count()}") if torch.cuda.is_available() \
        else torch.device("cpu")
    progress = Path(out_dir) / "progress"
    done = [0]

    def tick() -> None:
        done[0] += 1
        if rank == 0:
            progress.write_text(str(done[0]))

    result: dict[str, object] = {"gemm": {}, "collectives": {}, "layers": {}, "optimizer": {}}
    for dtype in config.dtypes:
        result["gemm"].update(gemm_flops(list(config.gemm_shapes), [dtype], device,  # type: ignore[attr-defined]
                                         repeats=config.repeats))
        tick()
    if world > 1:
        result["collectives"] = collective_fits(list(config.message_bytes), world, rank, device,
                                                repeats=config.repeats, tick=tick)
        if config.models:  # FSDP2's per-unit gather and reduce-scatter, copies included
            result["collectives"].update(fsdp_unit_fits(
                catalog_model(config.models[0], config.seq_len), world, device,
                dtype=config.dtypes[0], repeats=config.repeats,
                max_blocks=config.fsdp_unit_blocks, tick=tick))
    for name in config.models:
        model = catalog_model(name, config.seq_len)
        for micro_batch in config.micro_batches:
            for dtype in config.dtypes:
                result["layers"].update(layer_times(model, micro_batch, dtype, device,  # type: ignore[attr-defined]
                                                    repeats=config.repeats))
                tick()
        result["optimizer"][name] = optimizer_fit(model, device, repeats=config.repeats)  # type: ignore[index]
        tick()
    if rank == 0:
        (Path(out_dir) / "rank0.json").write_text(json.dumps(result))


def timing_bytes(config: ProfileConfig) -> tuple[float, str]:
    """The most memory one process's layer timings take (the largest micro-batch through one
    block of each model, forward and backward: its activations, their gradients, and the s x s
    attention scores a CPU kernel may hold), and the model that takes it."""
    worst, name = 0.0, ""
    for model_name in config.models:
        model = load_model(model_name, config.seq_len)
        block = next(layer for layer in model.layers if layer.kind == LayerKind.BLOCK)
        tokens = max(config.micro_batches) * model.seq_len
        scores = 4.0 * model.num_heads * model.seq_len  # fp32 scores per token, per block
        kept = block.activation[Recompute.NONE].per_rank(1, False)
        need = tokens * (2 * kept * 4 / model.dtype_bytes + scores)  # fp32 on CPU
        if need > worst:
            worst, name = need, model_name
    return worst, name


def check_fits_memory(config: ProfileConfig, memory_bytes: float | None = None) -> None:
    """Refuse, before any process starts, timings that all processes together cannot hold."""
    memory_bytes = memory_bytes or host_memory_bytes()
    need, name = timing_bytes(config)
    if need * config.nproc > memory_bytes:
        raise ValueError(
            f"timing a block of {name} at seq_len {config.seq_len or 'its own'} and micro-batch "
            f"{max(config.micro_batches)} needs about {need / 2**30:,.1f} GiB per process, "
            f"{need * config.nproc / 2**30:,.1f} GiB for {config.nproc} processes, more than this "
            f"machine's {memory_bytes / 2**30:,.1f} GiB; lower --seq-len or --nproc")


def progress_poll(path: Path, on_progress: Callable[[int], None] | None) -> Callable[[], None]:
    """A ``spawn`` poll that hands ``on_progress`` the count rank 0 last wrote to ``path``."""
    def poll() -> None:
        if on_progress is not None and path.exists() and (text := path.read_text()):
            on_progress(int(text))
    return poll


def run_profile(config: ProfileConfig, *, on_progress: Callable[[int], None] | None = None,
                timeout_s: float = 600.0) -> Profile:
    """Measure with ``config.nproc`` processes; returns the Profile (rank 0's figures: every
    rank ran the same work at the same time)."""
    check_fits_memory(config)
    with tempfile.TemporaryDirectory(prefix="meshmorph-profile-") as tmp:
        spawn(_rank_job, config.nproc, (config, tmp), Path(tmp), timeout_s=timeout_s,
              poll=progress_poll(Path(tmp) / "progress", on_progress), nice=config.nice)
        result = json.loads((Path(tmp) / "rank0.json").read_text())
    return assemble(config, result)


def assemble(config: ProfileConfig, result: dict) -> Profile:  # type: ignore[type-arg]
    """The Profile from rank 0's measurements (on CPU the ``loopback`` link from the whole
    group's all-reduce fit; on GPUs the catalog's links stay as they are)."""
    import torch

    from meshmorph.spec.gpus import GPU_CATALOG

    cuda = torch.cuda.is_available()
    bandwidth, latency = ({}, {}) if cuda else loopback_link(result["collectives"], config.nproc)
    fixed, per_param = next(iter(result["optimizer"].values()), (0.0, 0.0))
    best = max((v for k, v in result["gemm"].items() if k.startswith("fp32")), default=0.0)
    efficiency = {} if cuda else {"cpu": best / GPU_CATALOG["cpu"].peak_flops("fp32")}
    return Profile(
        matmul_efficiency=efficiency, link_bandwidth_gbps=bandwidth, link_latency_us=latency,
        source=f"meshmorph profile, {config.nproc} {'GPU' if cuda else 'CPU'} processes, "
               f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        gemm_flops_per_s=result["gemm"], collectives=result["collectives"],
        layer_times=result["layers"], optimizer_s_per_param=per_param, optimizer_fixed_s=fixed,
        processes=config.nproc, cores=os.cpu_count() or 0, load_avg=os.getloadavg()[0])
