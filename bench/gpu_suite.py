"""One-GPU benchmark suite: meshmorph's training step (eager and torch.compile) beside the cost
model, raw ceilings for calibration, and the streams CUDA-graph path.

Run once on a machine with one NVIDIA H100 or H200, from the repository root:

    PYTHONPATH=src python bench/gpu_suite.py

Sections (``--sections``, in this order; each case sits in its own try/except, so a failing case
or section records its error text in the JSON and the suite goes on):

``ceilings``  an 8192^3 bf16 matmul (median of 10 after warm-up, random data), a device-to-device
              copy (GB/s counted as read + write), the GEMMs of one gpt3-1.3b block at 8192 tokens
              (QKV, proj, fc1, fc2: forward, and the dgrad / wgrad GEMMs of backward) and of one
              llama3.2-1b block plus both vocabulary heads, SDPA forward and forward+backward at
              (b 4, 16 heads, s 2048, d 128) with the flash and with the cuDNN backend (FLOPs
              counted causal, half the square), Llama's grouped-query shape the engine's way
              (repeat_interleave) against ``enable_gqa=True``, and which SDPA backend the engine's
              own ``Block`` dispatches to (profiler: on an H100 with torch 2.11 it is cuDNN's
              fused flash-style kernel, not FlashAttention-2).
``step``      meshmorph's engine on one GPU: ``build_engine`` under the pure single-device plan
              (tp = pp = dp = 1, zero 0, bf16 autocast, no recompute, 2 micro-batches of b
              sequences at seq 2048), eager and with ``[train] compile = true``'s path (the
              trainer's ``resolve_backend`` + ``compile_blocks``: each transformer block's forward
              compiled by inductor, embedding / head / loss eager). Per case: the median, min and
              max of the timed steps (device synchronised around each step), MFU = model FLOPs per
              step / step time / dense bf16 peak (the cost model's numerator), max_memory_allocated
              and max_memory_reserved, the memory allocated before the first step (weights), one
              forward+backward without the optimizer and the optimizer step alone (medians of a
              few), and beside them ``CostModel.estimate`` for the same plan: step time with its
              breakdown, peak memory with and without its reserve, and the memory breakdown.
              A case that runs out of memory is recorded as ``oom``, not raised.
``streams``   bench/streams.py's ``cuda_case`` at batch 1 for each streams net: eager,
              ``torch.compile(mode="reduce-overhead")``, single- and multi-stream CUDA graphs.

Engine reuse: a model is built once (the weights are drawn on the host: 8-25 s for 1.3B
parameters); each further case gets a fresh ``TrainEngine`` (new optimizers and LR schedule, new
first-step capture) over the same model parts, gradients dropped and the allocator emptied in
between, and the compiled cases compile those same parts in place, as the trainer does after
``build_engine``. Peak memory is reset before each case's first step, so it covers that case's
steps (the resident weights included), never the build.

Budget (an H100, estimated from a validation run there with torch 2.11: a gpt3-125m block's
forward + backward compiled by inductor in ~9 s, 125M parameters built in 0.8 s, one streams net
in 5 s; the whole run must stay under 7 minutes):

    start-up (imports, CUDA context, NCCL one-rank group)               ~10 s
    ceilings (33 GEMMs, matmul, copy, 4 SDPA, 2 GQA, 2 kernel checks)   ~8-12 s   (budget 25 s)
    step, per model: build 8-25 s, eager b 8 ~15 s, eager b 4 ~8 s,
          compile b 8 (first compiled step 10-40 s, then ~10 s of steps),
          compile b 4 (a second graph for the new shape: 10-30 s + ~6 s) ~70-130 s
          two models                                                    ~140-260 s (budget 285 s)
    streams: 3 nets x (op-graph profile, reduce-overhead compile,
          CUDA graph captures, 20 timed forwards)                       ~15-30 s  (budget 60 s)
    total                                                               ~180-320 s

Every case checks the time left in its section (and in the whole run) against its own estimate
before it starts, and is recorded as ``skipped: budget`` when it does not fit; a watchdog ends
the process at ``--budget-s`` (390 s after the imports by default) after writing the JSON and
the summary.
``--quick`` keeps b 8 only, 4 timed steps, forward GEMMs only, no forward/backward split and one
streams net (~2 minutes).

Command line: ``--quick``, ``--out PATH`` (default bench/results/latest/gpu_suite.json, rewritten
after every case; ``--update`` for the committed bench/results/gpu_suite.json),
``--sections step,ceilings,streams`` (any subset; they run in the order above),
``--models`` (default gpt3-1.3b llama3.2-1b), ``--micro-batches`` (default 8 4),
``--compile-micro-batches`` (default: every b that ran eagerly), ``--modes eager,compile``,
``--dtype fp8 --fp8-scaling R`` (float8 linear layers through torchao; bench/gpu_fp8.py collects
such runs beside bf16's),
``--device cpu`` (automatic without CUDA): a smoke test in well under a minute (fp32, gloo,
gpt-tiny and llama-tiny at seq 32, eager only, tiny ceilings, one streams net on the CPU path).

Targets checked later (the suite measures; it does not adjust anything): MFU >= 45% with compile
for both models, predicted step within +-10% of the measured median, predicted peak memory
without the reserve within +-5% of max_memory_allocated (the predicted total is also put beside
max_memory_reserved). The summary prints these checks.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import math
import os
import platform
import socket
import statistics
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("meshmorph") is None:  # run without PYTHONPATH=src
    sys.path.insert(0, str(ROOT / "src"))

from meshmorph.cost.coefficients import CostCoefficients  # noqa: E402
from meshmorph.cost.estimate import GIB, Estimate  # noqa: E402
from meshmorph.cost.model import CostModel  # noqa: E402
from meshmorph.cost.rank_terms import device_reserve_bytes  # noqa: E402
from meshmorph.run.config import OptimConfig  # noqa: E402
from meshmorph.run.engine.train_engine import TrainEngine, build_engine, validate_plan  # noqa: E402
from meshmorph.spec import ModelSpec, gpu, load_model, parse_cluster  # noqa: E402
from meshmorph.spec.plan import Plan  # noqa: E402
from results_path import Outputs, shown  # noqa: E402

OUTPUTS = Outputs("bench/results/gpu_suite.json")
GPU_MODELS = ("gpt3-1.3b", "llama3.2-1b")
"""Default step cases on CUDA."""
CPU_MODELS = ("gpt-tiny", "llama-tiny")
"""Default step cases with --device cpu."""
SECTIONS = ("ceilings", "step", "streams")
"""Every section, in the order they run."""
SECTION_BUDGET_S = {"ceilings": 25.0, "step": 285.0, "streams": 60.0}
"""Wall-clock budget of each section on CUDA (the CPU smoke test uses a quarter)."""
TOTAL_BUDGET_S = 390.0
"""The watchdog's limit for the whole run (seconds from the end of the imports, which take
~5-10 s): the run stays under 7 minutes."""
NUM_MICROBATCHES = 2
"""Micro-batches per step (gradient accumulation)."""
SEED = 0
"""Weights and token batches."""
HOST_INIT_PARAMS_PER_S = 50e6
"""Parameters per second that build_engine draws on the host (1.3B took ~25 s on the H100 box):
the build's estimate for the budget guard."""
COMPILE_ALLOWANCE_S = 45.0
"""What the first compiled step of a model may take, for the budget guard."""
STARTED = time.perf_counter()


# --- results file, printing and budgets --------------------------------------------------------
def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    return repr(value)


class Recorder:
    """The JSON result, rewritten (atomically) after every case; printing goes through it too."""

    def __init__(self, out: Path, meta: dict[str, Any]) -> None:
        self.out = out
        self.lock = threading.RLock()
        self.data: dict[str, Any] = {"meta": meta, "sections": {}, "complete": False}
        self.lines: list[str] = []

    def section(self, name: str) -> dict[str, Any]:
        with self.lock:
            return self.data["sections"].setdefault(name, {"status": "running", "cases": []})

    def add(self, section: str, case: dict[str, Any], line: str | None = None) -> None:
        with self.lock:
            self.section(section)["cases"].append(case)
            self.save()
        if line is not None:
            emit(line)

    def save(self) -> None:
        with self.lock:
            self.data["wall_s"] = time.perf_counter() - STARTED
            self.out.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.out.with_name(self.out.name + ".tmp")
            tmp.write_text(json.dumps(self.data, indent=1, default=_jsonable) + "\n")
            os.replace(tmp, self.out)


def emit(line: str) -> None:
    print(line, flush=True)


def error_text(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}"[:300]


def error_record(exc: BaseException) -> dict[str, Any]:
    return {"status": f"error: {error_text(exc)}",
            "traceback": traceback.format_exception(exc)[-6:]}


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


class Budget:
    """A section's deadline: its own budget, and never past the run's end minus what the later
    sections were promised."""

    def __init__(self, seconds: float, run_end: float, reserve_after: float) -> None:
        now = time.perf_counter()
        self.end = min(now + seconds, run_end - reserve_after)

    def left(self) -> float:
        return self.end - time.perf_counter()

    def allows(self, estimate_s: float) -> bool:
        return self.left() >= estimate_s


# --- device set-up -----------------------------------------------------------------------------
def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def pick_gpu(device: torch.device, requested: str | None) -> str:
    """The GPU catalog name that the prediction uses."""
    if requested:
        return gpu(requested).name  # raises with the list of known names
    if device.type == "cpu":
        return "cpu"
    name = device_name(device).upper()
    for key in ("H200", "H100"):
        if key in name:
            return key.lower()
    raise SystemExit(f"cannot tell the catalog GPU of {device_name(device)!r}; pass --gpu NAME "
                     "(see `meshmorph gpus` or meshmorph/spec/gpus.py)")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def init_single_rank(device: torch.device) -> None:
    """A one-rank default process group in this process (no torchrun), with the trainer's
    backends (run/trainer.py: nccl for CUDA tensors, gloo for CPU ones)."""
    if dist.is_initialized():
        return
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("cuda:nccl,cpu:gloo", rank=0, world_size=1)
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def backend_flags() -> dict[str, Any]:
    """Set the matmul / cuDNN flags explicitly to what the engine runs with: it sets none, so
    torch's defaults (fp32 matmuls in IEEE fp32, no TF32; cuDNN convolutions may use TF32; bf16
    GEMMs may reduce in reduced precision). Returns them, with the SDPA backends enabled."""
    flags: dict[str, Any] = {}
    with contextlib.suppress(Exception):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
        torch.backends.cudnn.benchmark = False
    readers: dict[str, Callable[[], Any]] = {
        "matmul.allow_tf32": lambda: torch.backends.cuda.matmul.allow_tf32,
        "matmul.fp32_precision": lambda: torch.backends.cuda.matmul.fp32_precision,
        "float32_matmul_precision": torch.get_float32_matmul_precision,
        "matmul.allow_bf16_reduced_precision_reduction":
            lambda: torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        "cudnn.allow_tf32": lambda: torch.backends.cudnn.allow_tf32,
        "cudnn.benchmark": lambda: torch.backends.cudnn.benchmark,
        "sdp.flash": torch.backends.cuda.flash_sdp_enabled,
        "sdp.mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled,
        "sdp.cudnn": lambda: torch.backends.cuda.cudnn_sdp_enabled(),
        "sdp.math": torch.backends.cuda.math_sdp_enabled,
    }
    for key, read in readers.items():
        try:
            flags[key] = read()
        except Exception as exc:  # an API another torch version lacks
            flags[key] = f"n/a ({type(exc).__name__})"
    return flags


def describe(device: torch.device, gpu_name: str, dtype: str) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "device": device_name(device), "device_type": device.type, "gpu": gpu_name,
        "dtype": dtype, "torch": torch.__version__, "cuda": torch.version.cuda,
        "python": platform.python_version(), "host": platform.node(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"), "flags": backend_flags(),
    }
    with contextlib.suppress(Exception):
        import triton

        meta["triton"] = triton.__version__
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        meta |= {"capability": f"{props.major}.{props.minor}", "sms": props.multi_processor_count,
                 "memory_gib": props.total_memory / GIB,
                 "cudnn": torch.backends.cudnn.version()}
    return meta


# --- plan and prediction -----------------------------------------------------------------------
def make_plan(spec: ModelSpec, micro_batch: int, num_microbatches: int, dtype: str,
              compile: bool = False, fp8_scaling: str = "tensorwise") -> Plan:
    """tp = pp = dp = 1, zero 0, no recompute: the whole model on one device, eager or with its
    blocks compiled (``Plan.compile``: priced as such); dtype fp8 with its scaling recipe."""
    extra = {"fp8_scaling": fp8_scaling} if dtype == "fp8" else {}
    return Plan(model=spec.name, seq_len=spec.seq_len, global_batch=micro_batch * num_microbatches,
                micro_batch=micro_batch, num_microbatches=num_microbatches, zero=0,
                dtype=dtype, compile=compile, **extra).with_even_stages(spec)


def predict(spec: ModelSpec, plan: Plan, gpu_name: str, ceiling: float | None = None) -> Estimate:
    coef = CostCoefficients() if ceiling is None else CostCoefficients(matmul_efficiency=ceiling)
    return CostModel(spec, parse_cluster(f"{gpu_name}:1x1"), coef).estimate(plan)


def time_split(spec: ModelSpec, plan: Plan, gpu_name: str) -> tuple[float, float]:
    """(A, B) with predicted step time = A / ceiling + B for this plan.

    Every compute term of the estimate is FLOPs / (peak x ceiling x f(width) x g(tokens)), so
    linear in 1 / ceiling; the rest (optimizer HBM time; no communication on one GPU) does not
    depend on it. Two estimates, at the default ceiling c1 and at c1 / 2, give A and B."""
    c1 = CostCoefficients().matmul_efficiency
    c2 = c1 / 2
    t1 = predict(spec, plan, gpu_name, c1).step_time_s
    t2 = predict(spec, plan, gpu_name, c2).step_time_s
    a = (t2 - t1) / (1 / c2 - 1 / c1)
    return a, t1 - a / c1


def prediction_record(spec: ModelSpec, plan: Plan, gpu_name: str, dtype: str) -> dict[str, Any]:
    """The case's fields known before it runs: the plan, the model FLOPs and the estimate (an
    estimate that fails is recorded as ``prediction_error``; the case still runs)."""
    tokens = plan.global_batch * plan.seq_len
    record: dict[str, Any] = {
        "model": spec.name, "params": spec.num_params, "seq_len": plan.seq_len,
        "micro_batch": plan.micro_batch, "num_microbatches": plan.num_microbatches,
        "global_batch": plan.global_batch, "dtype": dtype, "gpu": gpu_name,
        "tokens_per_step": tokens,
        "model_flops_per_step": tokens * spec.model_flops_per_token(),  # the estimate's numerator
        # MFU against the 16-bit peak for fp8 too, as the cost model and torchtitan count it
        "peak_flops": gpu(gpu_name).peak_flops("bf16" if dtype == "fp8" else dtype),
        "plan": plan.to_dict(),
    }
    try:
        est = predict(spec, plan, gpu_name)
        split = time_split(spec, plan, gpu_name)
    except Exception as exc:
        return record | {"prediction_error": error_text(exc)}
    memory = est.memory[0]
    cost = CostModel(spec, parse_cluster(f"{gpu_name}:1x1"))
    reserve = device_reserve_bytes(cost, cost.default_gpu())  # CUDA context, allocator slack
    return record | {
        "predicted_step_s": est.step_time_s, "predicted_mfu": est.mfu,
        "predicted_peak_gib": memory.total / GIB,
        # what max_memory_allocated sees: everything but the context and the allocator's slack
        # (the loss's buffers included)
        "predicted_allocated_gib": (memory.total - reserve) / GIB,
        "predicted_memory_gib": {key: getattr(memory, key) / GIB for key in (
            "params", "grads", "optimizer", "activations", "buffers", "reserved")},
        "predicted_fits": est.fits, "predicted_breakdown_s": dict(est.breakdown_s),
        "time_split_s": split,
    }


# --- fits of the cost model's ceiling (moved from bench/gpu_step.py) ---------------------------
def _fit_terms(cases: list[dict[str, Any]]) -> tuple[list[float], list[float], list[float]]:
    """For the cases that ran: a_i = A_i / M_i, r_i = 1 - B_i / M_i and 1 / M_i, where A_i, B_i
    are the case's time_split_s and M_i its measured median step time."""
    done = [c for c in cases if c.get("status") == "ok" and "ratio" in c]
    a = [c["time_split_s"][0] / c["measured_step_s"] for c in done]
    r = [1 - c["time_split_s"][1] / c["measured_step_s"] for c in done]
    inv = [1 / c["measured_step_s"] for c in done]
    return a, r, inv


def fit_ceiling(cases: list[dict[str, Any]]) -> float | None:
    """The ceiling c minimising sum_i (predicted_i(c) / measured_i - 1)^2 (relative errors).

    With predicted_i(c) = A_i x + B_i and x = 1 / c, the residual is a_i x - r_i (a_i = A_i / M_i,
    r_i = 1 - B_i / M_i); the least-squares x is sum(a_i r_i) / sum(a_i^2), and c = 1 / x."""
    a, r, _ = _fit_terms(cases)
    if not a:
        return None
    x = sum(ai * ri for ai, ri in zip(a, r, strict=True)) / sum(ai * ai for ai in a)
    return 1 / x if x > 0 else None


def fit_ceiling_and_overhead(cases: list[dict[str, Any]]) -> tuple[float, float] | None:
    """(ceiling, seconds) of the same relative least squares with a fixed per-step overhead o
    added to every prediction, predicted_i = A_i x + B_i + o: residual a_i x + o / M_i - r_i,
    solved by the 2 x 2 normal equations."""
    a, r, inv = _fit_terms(cases)
    s_aa = sum(ai * ai for ai in a)
    s_ab = sum(ai * bi for ai, bi in zip(a, inv, strict=True))
    s_bb = sum(bi * bi for bi in inv)
    s_ar = sum(ai * ri for ai, ri in zip(a, r, strict=True))
    s_br = sum(bi * ri for bi, ri in zip(inv, r, strict=True))
    det = s_aa * s_bb - s_ab * s_ab
    if len(a) < 2 or abs(det) <= 1e-12 * s_aa * s_bb:
        return None
    x = (s_ar * s_bb - s_br * s_ab) / det
    overhead = (s_aa * s_br - s_ab * s_ar) / det
    return (1 / x, overhead) if x > 0 else None


def summarise(cases: list[dict[str, Any]]) -> dict[str, Any]:
    errors = [abs(c["ratio"] - 1) for c in cases if c.get("status") == "ok" and "ratio" in c]
    both = fit_ceiling_and_overhead(cases)
    return {
        "cases_ok": len(errors),
        "median_abs_ratio_error": statistics.median(errors) if errors else None,
        "max_abs_ratio_error": max(errors) if errors else None,
        "fitted_matmul_efficiency": fit_ceiling(cases),
        "fitted_with_overhead": dict(zip(("matmul_efficiency", "overhead_s"), both, strict=True))
        if both else None,
        "default_matmul_efficiency": CostCoefficients().matmul_efficiency,
    }


def summary_lines(summary: dict[str, Any]) -> list[str]:
    if not summary["cases_ok"]:
        return ["no case ran"]
    fitted, both = summary["fitted_matmul_efficiency"], summary["fitted_with_overhead"]
    fit = "n/a" if fitted is None else f"{fitted:.3f}"
    if fitted is not None and fitted > 1:
        fit += " (above 1: no ceiling explains it; CostCoefficients accepts (0, 1])"
    lines = [f"|pred/meas - 1| over {summary['cases_ok']} cases: median "
             f"{summary['median_abs_ratio_error']:.3f}, max {summary['max_abs_ratio_error']:.3f}",
             f"least-squares matmul-efficiency ceiling: {fit} "
             f"(cost model default {summary['default_matmul_efficiency']:.2f})"]
    if both:
        lines.append(f"with a fixed per-step overhead fitted too: ceiling "
                     f"{both['matmul_efficiency']:.3f}, overhead {both['overhead_s'] * 1e3:.1f} ms")
    return lines


# --- the engine's step --------------------------------------------------------------------------
def drop_grads(engine: TrainEngine) -> None:
    for part in engine.model_parts:
        for param in part.parameters():
            param.grad = None


def engine_for(engine: TrainEngine, plan: Plan) -> TrainEngine:
    """A fresh engine (new optimizers and LR schedules, new first-step capture) over the model
    parts of ``engine``, for another single-device plan of the same model. Only for tp = pp =
    dp = 1, where the parts run themselves (no DDP / FSDP wrapper) and the mesh does not depend
    on the micro-batch. The caller drops its reference to the old engine."""
    if plan.world_size != 1 or engine.plan.world_size != 1:
        raise ValueError("engine_for re-plans single-device engines only")
    validate_plan(engine.spec, plan, 1)
    drop_grads(engine)
    for opt in engine.optimizers:
        opt.state.clear()
    return TrainEngine(spec=engine.spec, plan=plan, optim=engine.optim, mesh=engine.train_mesh,
                       model_parts=list(engine.model_parts), runners=list(engine.model_parts),
                       chunk_ids=list(engine.chunk_ids), device=engine.device)


def token_batches(plan: Plan, vocab: int, device: torch.device) -> Iterator[torch.Tensor]:
    """Fresh random tokens [global_batch, seq_len + 1] on the device, one batch per step."""
    generator = torch.Generator(device=device).manual_seed(SEED)
    shape = (plan.global_batch, plan.seq_len + 1)
    while True:
        yield torch.randint(0, vocab, shape, generator=generator, device=device)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    synchronize(device)
    start = time.perf_counter()
    out = fn()
    synchronize(device)
    return time.perf_counter() - start, out


KERNEL_KINDS = (  # (kind, lower-case substrings of a CUDA kernel's name), first match wins
    ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "sm90_", "matmul", "wgmma")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("loss", ("softmax", "nll", "cross_entropy", "logsumexp")),
    ("norm", ("layer_norm", "layernorm", "rms", "norm")),
    ("copy_cast", ("copy", "cast", "to_copy", "catarray", "memcpy", "memset", "fill")),
    ("triton", ("triton",)),
    ("reduce", ("reduce",)),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "index")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "other")


def kernel_breakdown(engine: TrainEngine, batches: Iterator[torch.Tensor], device: torch.device,
                     steps: int) -> dict[str, Any]:
    """CUDA kernel time per step by kind (KERNEL_KINDS) over ``steps`` profiled steps, the busy
    share of the wall time, and the 15 costliest kernels: where a step's time goes."""
    from torch.profiler import ProfilerActivity, profile

    synchronize(device)
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step(next(batches))
        synchronize(device)
    wall = time.perf_counter() - start
    per_kind: dict[str, float] = {}
    per_kernel: dict[str, float] = {}
    for event in prof.events():
        if getattr(event, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        ms = event.device_time / 1e3 / steps  # us -> ms per step
        per_kind[kernel_kind(event.name)] = per_kind.get(kernel_kind(event.name), 0.0) + ms
        per_kernel[event.name] = per_kernel.get(event.name, 0.0) + ms
    busy = sum(per_kind.values())
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:15]
    return {"kernel_ms_per_step": dict(sorted(per_kind.items(), key=lambda kv: -kv[1])),
            "kernel_busy_ms_per_step": busy, "profiled_wall_ms_per_step": wall * 1e3 / steps,
            "top_kernels_ms_per_step": [[name[:120], ms] for name, ms in top]}


def measure_steps(engine: TrainEngine, plan: Plan, device: torch.device, warmup: int, steps: int,
                  split_repeats: int, profile_steps: int = 0) -> dict[str, Any]:
    """Warm-up and timed steps; peak memory; then (split_repeats > 0) forward+backward alone and
    the optimizer step alone, each timed a few times."""
    batches = token_batches(plan, engine.spec.vocab_size, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    row: dict[str, Any] = {}
    if device.type == "cuda":
        row["allocated_at_start_gib"] = torch.cuda.memory_allocated(device) / GIB
    warm, times, losses = [], [], []
    for step in range(warmup + steps):
        tokens = next(batches)
        seconds, loss = timed(lambda t=tokens: engine.step(t), device)
        losses.append(loss)
        (times if step >= warmup else warm).append(seconds)
    row |= {"warmup_step_times_s": warm, "step_times_s": times, "losses": losses,
            "measured_step_s": statistics.median(times), "measured_step_min_s": min(times),
            "measured_step_max_s": max(times), "loss_finite": all(map(math.isfinite, losses))}
    if device.type == "cuda":
        row["measured_peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        row["measured_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
    with contextlib.suppress(Exception):
        row["captured_state"] = dict(engine.captured_state or {})
    with contextlib.suppress(Exception):
        row["optimizer_fused"] = [opt.defaults.get("fused") for opt in engine.optimizers]
    if profile_steps > 0 and device.type == "cuda":
        try:
            row["profile"] = kernel_breakdown(engine, batches, device, profile_steps)
        except Exception as exc:  # the profiler is a diagnosis: the case's figures still stand
            row["profile_error"] = error_text(exc)
    if split_repeats > 0:
        try:
            fwd_bwd, optimizer = [], []
            for _ in range(split_repeats):
                tokens = next(batches)
                fwd_bwd.append(timed(lambda t=tokens: engine._forward_backward(t), device)[0])
                optimizer.append(timed(lambda: [opt.step() for opt in engine.optimizers],
                                       device)[0])
            row["fwd_bwd_s"] = statistics.median(fwd_bwd)
            row["optimizer_s"] = statistics.median(optimizer)
            row["rest_of_step_s"] = row["measured_step_s"] - row["fwd_bwd_s"] - row["optimizer_s"]
        except Exception as exc:  # a private method another version renamed: the step still ran
            row["split_error"] = error_text(exc)
    return row


def step_case_line(case: dict[str, Any]) -> str:
    head = f"step {case['model']:12s} {case['mode']:7s} b {case['micro_batch']:2d}"
    if case["status"] != "ok":
        return f"{head}  {case['status'][:110]}"
    gib, resv = case.get("measured_peak_gib"), case.get("measured_reserved_gib")
    mem = f"peak {gib:5.1f}/{resv:5.1f} GiB" if gib is not None else "peak n/a"
    warm = ""
    if case["mode"] == "compile" and case.get("warmup_step_times_s"):
        warm = f" warm-up {'/'.join(f'{t:.1f}' for t in case['warmup_step_times_s'])} s"
    measured = (f"{head}  {case['measured_step_s'] * 1e3:8.1f} ms "
                f"[{case['measured_step_min_s'] * 1e3:.0f}-"
                f"{case['measured_step_max_s'] * 1e3:.0f}] MFU {case['measured_mfu']:5.1%}")
    if "ratio" not in case:
        return f"{measured}  {mem}{warm}  (no prediction: {case.get('prediction_error')})"
    return (f"{measured}  pred {case['predicted_step_s'] * 1e3:7.1f} ms (x{case['ratio']:.2f})  "
            f"{mem} (pred {case['predicted_allocated_gib']:.1f}"
            f"+res {case['predicted_peak_gib']:.1f}){warm}")


def finish_case(case: dict[str, Any]) -> dict[str, Any]:
    measured = case["measured_step_s"]
    case |= {"status": "ok",
             "measured_mfu": case["model_flops_per_step"] / measured / case["peak_flops"],
             "measured_tokens_per_s": case["tokens_per_step"] / measured}
    if "predicted_step_s" not in case:  # the estimate failed: prediction_error says why
        return case
    case["ratio"] = case["predicted_step_s"] / measured
    if case.get("measured_peak_gib"):
        # memory an earlier case left allocated (held at this case's start beyond the weights)
        # sits under its whole peak: the case's own peak is without it
        left = max(0.0, case.get("allocated_at_start_gib", 0.0) - case.get("resident_gib", 0.0))
        case["left_over_gib"] = left
        case["measured_case_peak_gib"] = case["measured_peak_gib"] - left
        case["peak_ratio_allocated"] = (case["predicted_allocated_gib"]
                                        / case["measured_case_peak_gib"])
        case["peak_ratio_reserved"] = case["predicted_peak_gib"] / case["measured_reserved_gib"]
    return case


class StepSection:
    """The engine cases: per model, one build, then eager micro-batch sizes, then compile."""

    def __init__(self, args: argparse.Namespace, device: torch.device, gpu_name: str, dtype: str,
                 rec: Recorder | None, budget: Budget | None) -> None:
        self.args, self.device, self.gpu_name, self.dtype = args, device, gpu_name, dtype
        self.rec, self.budget = rec, budget
        self.cases: list[dict[str, Any]] = []
        self._fresh = False  # the engine was just built and has not stepped
        self._compiled_with: str | None = None  # the backend the current parts were compiled by

    def _add(self, case: dict[str, Any]) -> None:
        self.cases.append(case)
        line = step_case_line(case)
        if self.rec is not None:
            self.rec.add("step", case, line)
        else:
            emit(line)

    def _estimate_s(self, case: dict[str, Any], mode: str, warmup: int) -> float:
        steps = warmup + self.args.steps + 2 * self.args.split_repeats
        run = 2.5 * steps * case.get("predicted_step_s", 1.0) + 3.0  # the estimate is optimistic
        allowance = COMPILE_ALLOWANCE_S if self.device.type == "cuda" else 10.0
        return run + (allowance if mode == "compile" else 0.0)

    def run_model(self, name: str) -> None:
        args, device = self.args, self.device
        try:
            spec = load_model(name, args.seq_len)
        except Exception as exc:
            self._add({"model": name, "mode": "-", "micro_batch": 0, **error_record(exc)})
            return
        batches = sorted(set(args.micro_batches), reverse=True)
        plans = {b: make_plan(spec, b, args.num_microbatches, self.dtype,
                              fp8_scaling=args.fp8_scaling) for b in batches}
        records = {b: prediction_record(spec, plans[b], self.gpu_name, self.dtype)
                   for b in batches}
        build_est = spec.num_params / HOST_INIT_PARAMS_PER_S + 2.0
        first_est = self._estimate_s(records[batches[0]], "eager", args.warmup)
        if self.budget is not None and not self.budget.allows(build_est + first_est):
            for b in batches:
                self._add(records[b] | {"mode": "eager", "status": "skipped: budget"})
            return
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        try:
            started = time.perf_counter()
            engine = build_engine(spec, plans[batches[0]], OptimConfig(), seed=SEED, device=device)
            build_s = time.perf_counter() - started
            self._fresh, self._compiled_with = True, None
            release(device)
            self._resident = torch.cuda.memory_allocated(device) / GIB \
                if device.type == "cuda" else 0.0  # the weights (and nothing else yet)
        except Exception as exc:
            for b in batches:
                self._add(records[b] | {"mode": "eager", **error_record(exc)})
            release(device)
            return
        eager_ok: list[int] = []
        if "eager" in args.modes:
            for b in batches:
                engine = self._run(engine, records[b] | {"mode": "eager", "build_s": build_s,
                                                         "resident_gib": self._resident},
                                   plans[b], args.warmup)
                build_s = 0.0
                if self.cases[-1]["status"] == "ok":
                    eager_ok.append(b)
        if "compile" in args.modes:
            self._compiled(engine, spec, batches, eager_ok)
        del engine
        release(device)

    def _compiled(self, engine: TrainEngine, spec: ModelSpec, batches: list[int],
                  eager_ok: list[int]) -> None:
        args, device = self.args, self.device
        chosen = args.compile_micro_batches or (
            eager_ok[:1] if args.quick else eager_ok) or batches[:1]
        # the compiled cases' own plans (Plan.compile) and predictions
        plans = {b: make_plan(spec, b, args.num_microbatches, self.dtype, compile=True,
                              fp8_scaling=args.fp8_scaling) for b in chosen}
        records = {b: prediction_record(spec, plans[b], self.gpu_name, self.dtype)
                   | {"resident_gib": getattr(self, "_resident", 0.0)} for b in chosen}
        first = records[chosen[0]] | {"mode": "compile"}
        if self.budget is not None and not self.budget.allows(
                self._estimate_s(first, "compile", args.compile_warmup)):
            for b in chosen:
                self._add(records[b] | {"mode": "compile", "status": "skipped: budget"})
            return
        from meshmorph.run.parallel.compile import compile_blocks, resolve_backend

        try:
            choice = resolve_backend(args.compile_backend, device)
            count = compile_blocks(engine.model_parts, choice.backend)
        except Exception as exc:
            for b in chosen:
                self._add(records[b] | {"mode": "compile", **error_record(exc)})
            return
        self._compiled_with = choice.backend
        extra = {"mode": "compile", "compile_backend": choice.backend,
                 "compile_note": choice.note, "compiled_blocks": count}
        for b in chosen:
            engine = self._run(engine, records[b] | extra, plans[b], args.compile_warmup)
        with contextlib.suppress(Exception):
            from torch._dynamo.utils import counters

            self.cases[-1]["dynamo"] = {
                "unique_graphs": counters["stats"].get("unique_graphs"),
                "frames": dict(counters["frames"]),
                "graph_breaks": {str(k): v for k, v in counters["graph_break"].items()},
                "recompile_limit": getattr(torch._dynamo.config, "recompile_limit", None)
                or getattr(torch._dynamo.config, "cache_size_limit", None)}
        with contextlib.suppress(Exception):
            torch._dynamo.reset()

    def _run(self, engine: TrainEngine, case: dict[str, Any], plan: Plan,
             warmup: int) -> TrainEngine:
        """One case on a fresh engine over ``engine``'s parts; returns the engine to go on with."""
        args, device = self.args, self.device
        if self.budget is not None and not self.budget.allows(
                self._estimate_s(case, case["mode"], warmup)):
            self._add(case | {"status": "skipped: budget"})
            return engine
        try:
            if not (self._fresh and engine.plan == plan):
                engine = self._next_engine(engine, plan)
            self._fresh = False
            release(device)
            case |= measure_steps(engine, plan, device, warmup, args.steps, args.split_repeats,
                                  args.profile_steps)
            finish_case(case)
        except Exception as exc:
            case |= ({"status": f"oom: {error_text(exc)}"} if is_oom(exc)
                     else error_record(exc))
            del exc
            drop_grads(engine)
            for opt in engine.optimizers:
                opt.state.clear()
        release(device)
        self._add(case)
        return engine

    def _next_engine(self, engine: TrainEngine, plan: Plan) -> TrainEngine:
        """A fresh engine for ``plan`` over the same parts (engine_for); should the engine's
        constructor have changed, a new build, compiled again where the old parts were."""
        try:
            return engine_for(engine, plan)
        except TypeError:
            spec, device = engine.spec, self.device
            del engine
            release(device)
            fresh = build_engine(spec, plan, OptimConfig(), seed=SEED, device=device)
            if self._compiled_with is not None:
                from meshmorph.run.parallel.compile import compile_blocks

                compile_blocks(fresh.model_parts, self._compiled_with)
            return fresh

    def run(self) -> list[dict[str, Any]]:
        for name in self.args.models:
            self.run_model(name)
        return self.cases


def step_section(args: argparse.Namespace, device: torch.device, gpu_name: str, dtype: str,
                 rec: Recorder, budget: Budget) -> None:
    init_single_rank(device)
    runner = StepSection(args, device, gpu_name, dtype, rec, budget)
    cases = runner.run()
    section = rec.section("step")
    section["summary"] = {mode: summarise([c for c in cases if c.get("mode") == mode])
                          for mode in args.modes}


# --- ceilings ------------------------------------------------------------------------------------
def sample_times(fn: Callable[[], Any], device: torch.device, warmup: int,
                 repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls after ``warmup`` (CUDA events on CUDA)."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    if device.type != "cuda":
        out = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
        return out
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(repeats)]
    for begin, end in events:
        begin.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return [begin.elapsed_time(end) / 1e3 for begin, end in events]


def rate_record(name: str, seconds: list[float], flops: float = 0.0,
                bytes_moved: float = 0.0, **extra: Any) -> dict[str, Any]:
    median = statistics.median(seconds)
    rec: dict[str, Any] = {"name": name, "status": "ok", "median_s": median,
                           "min_s": min(seconds), "samples": len(seconds), **extra}
    if flops:
        rec["flops"] = flops
        rec["tflops"] = flops / median / 1e12
    if bytes_moved:
        rec["bytes"] = bytes_moved
        rec["gbps"] = bytes_moved / median / 1e9
    return rec


def ceiling_line(case: dict[str, Any]) -> str:
    if case["status"] != "ok":
        return f"ceil {case['name']:28s} {case['status'][:110]}"
    rate = (f"{case['tflops']:7.1f} TFLOP/s" if "tflops" in case
            else f"{case['gbps']:7.1f} GB/s" if "gbps" in case else "")
    note = f"  {case['note']}" if case.get("note") else ""
    return f"ceil {case['name']:28s} {case['median_s'] * 1e3:8.3f} ms {rate}{note}"


def block_gemms(name: str) -> list[tuple[str, int, int]]:
    """(label, in, out) of the linear layers of one block of a catalog model, and its head."""
    spec = load_model(name)
    h, f = spec.hidden_size, spec.ffn_hidden_size
    kv = spec.num_kv_heads * spec.head_dim
    if spec.arch == "gpt":
        shapes = [("qkv", h, 3 * h), ("proj", h, h), ("fc1", h, f), ("fc2", f, h)]
    else:
        shapes = [("q", h, h), ("kv", h, 2 * kv), ("o", h, h), ("w1w3", h, 2 * f), ("w2", f, h)]
    return [*shapes, ("head", h, spec.padded_vocab_size)]


def attention_kernels(name: str, device: torch.device, dtype: torch.dtype, seq: int) -> list[str]:
    """The aten attention ops the engine's own Block runs (forward + backward at b 1)."""
    from meshmorph.run.model.decoder import Block

    spec = load_model(name, seq)
    with torch.device(device):
        block = Block(spec)
    x = torch.randn(1, seq, spec.hidden_size, device=device, requires_grad=True)
    activities = [torch.profiler.ProfilerActivity.CPU]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.profiler.profile(activities=activities) as prof, \
                torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            block(x).float().sum().backward()
    synchronize(device)
    names = {e.key for e in prof.key_averages()}
    return sorted(n for n in names if n.startswith("aten::")
                  and ("attention" in n or "repeat_interleave" in n)
                  and n != "aten::scaled_dot_product_attention")


def ceilings_section(args: argparse.Namespace, device: torch.device, rec: Recorder,
                     budget: Budget) -> None:
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    size = 8192 if cuda else 256
    tokens = 8192 if cuda else 256
    warmup, repeats = (3, 10) if cuda else (1, 3)
    gen = torch.Generator(device=device).manual_seed(SEED)

    def randn(*shape: int, grad: bool = False) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=dtype, requires_grad=grad)

    def matmul() -> dict[str, Any]:
        a, b = randn(size, size), randn(size, size)
        c = torch.empty_like(a)
        seconds = sample_times(lambda: torch.mm(a, b, out=c), device, warmup, repeats)
        return rate_record(f"matmul {size}^3", seconds, flops=2.0 * size**3)

    def copy() -> dict[str, Any]:
        n = (2**30 if cuda else 2**24) // 2
        src = torch.empty(n, dtype=torch.bfloat16, device=device).fill_(1.0)
        dst = torch.empty_like(src)
        seconds = sample_times(lambda: dst.copy_(src), device, warmup, repeats)
        return rate_record(f"copy {n * 2 / 2**20:.0f} MiB d2d", seconds, bytes_moved=2.0 * n * 2,
                           note="bytes read + written")

    def gemm(model: str, label: str, k: int, n: int, kind: str) -> dict[str, Any]:
        if not cuda:
            k, n = min(k, 256), min(n, 512)
        x, w, g = randn(tokens, k), randn(n, k), randn(tokens, n)
        fns = {"fwd": lambda: torch.nn.functional.linear(x, w),  # [T, k] x [n, k]^T
               "dgrad": lambda: torch.mm(g, w),                  # [T, n] x [n, k]
               "wgrad": lambda: torch.mm(g.t(), x)}              # [n, T] x [T, k]
        seconds = sample_times(fns[kind], device, warmup, repeats)
        return rate_record(f"{model} {label} {kind}", seconds, flops=2.0 * tokens * k * n,
                           shape=[tokens, k, n], gemm=[model, label, kind])

    def sdpa(kind: str, backend: str = "flash") -> dict[str, Any]:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        b, heads, s, d = (4, 16, 2048, 128) if cuda else (1, 2, 128, 32)
        q, k, v = (randn(b, heads, s, d, grad=True) for _ in range(3))
        grad = randn(b, heads, s, d)
        chosen = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
        backends = [chosen[backend]] if cuda else [SDPBackend.MATH, SDPBackend.FLASH_ATTENTION]
        fwd_flops = 4.0 * b * heads * s * s * d / 2  # causal: half the scores

        def forward() -> torch.Tensor:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

        def both() -> None:
            forward().backward(grad)

        with sdpa_kernel(backends):
            if kind == "fwd":
                with torch.no_grad():
                    seconds = sample_times(forward, device, warmup, repeats)
                flops = fwd_flops
            else:
                seconds = sample_times(both, device, warmup, repeats)
                flops = 3.5 * fwd_flops  # backward: 2.5x the forward's matmuls
        return rate_record(f"sdpa {backend} {kind}", seconds, flops=flops,
                           shape=[b, heads, s, d], note="causal FLOPs")

    def gqa(kind: str) -> dict[str, Any]:
        b, heads, kv, s, d = (4, 32, 8, 2048, 64) if cuda else (1, 4, 2, 128, 16)
        q = randn(b, heads, s, d, grad=True)
        k, v = randn(b, kv, s, d, grad=True), randn(b, kv, s, d, grad=True)
        grad = randn(b, heads, s, d)
        sdpa_fn = torch.nn.functional.scaled_dot_product_attention

        def run() -> None:
            if kind == "repeat_interleave":  # run/model/decoder.py AttentionCore
                kk = k.repeat_interleave(heads // kv, dim=1)
                vv = v.repeat_interleave(heads // kv, dim=1)
                out = sdpa_fn(q, kk, vv, is_causal=True)
            else:
                out = sdpa_fn(q, k, v, is_causal=True, enable_gqa=True)
            out.backward(grad)

        seconds = sample_times(run, device, warmup, repeats)
        return rate_record(f"gqa fwd+bwd {kind}", seconds,
                           flops=3.5 * 4.0 * b * heads * s * s * d / 2, shape=[b, heads, kv, s, d])

    def engine_attention(name: str) -> dict[str, Any]:
        started = time.perf_counter()
        ops = attention_kernels(name, device, dtype, 2048 if cuda else 32)
        backend = ("cudnn" if any("cudnn" in op for op in ops)
                   else "flash" if any("flash" in op for op in ops)
                   else "efficient" if any("efficient" in op for op in ops) else "math")
        return {"name": f"engine sdpa {name}", "status": "ok", "ops": ops, "backend": backend,
                "median_s": time.perf_counter() - started,
                "note": f"backend {backend}: " + ", ".join(o.removeprefix("aten::") for o in ops
                                                            if "backward" not in o)}

    gemm_models = ("gpt3-1.3b", "llama3.2-1b") if cuda else ("gpt3-1.3b",)
    gemm_kinds = ("fwd", "dgrad", "wgrad") if cuda and not args.quick else ("fwd",)
    cases: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("matmul", matmul), ("copy", copy),
        ("sdpa fwd", lambda: sdpa("fwd")), ("sdpa fwd+bwd", lambda: sdpa("fwd+bwd")),
        *([("sdpa cudnn fwd", lambda: sdpa("fwd", "cudnn")),
           ("sdpa cudnn fwd+bwd", lambda: sdpa("fwd+bwd", "cudnn"))] if cuda else []),
        ("gqa repeat", lambda: gqa("repeat_interleave")), ("gqa native", lambda: gqa("enable_gqa")),
        ("engine sdpa gpt", lambda: engine_attention("gpt3-1.3b" if cuda else "gpt-tiny")),
        ("engine sdpa llama", lambda: engine_attention("llama3.2-1b" if cuda else "llama-tiny")),
        *[(f"{m} {label} {kind}", lambda m=m, label=label, k=k, n=n, kind=kind:
           gemm(m, label, k, n, kind))
          for m in gemm_models for label, k, n in block_gemms(m) for kind in gemm_kinds],
    ]
    for label, fn in cases:
        if not budget.allows(1.0):
            rec.add("ceilings", {"name": label, "status": "skipped: budget"},
                    f"ceil {label:28s} skipped: budget")
            continue
        try:
            case = fn()
        except Exception as exc:
            case = {"name": label, **error_record(exc)}
        rec.add("ceilings", case, ceiling_line(case))  # the tensors went with the closure


# --- streams -------------------------------------------------------------------------------------
def load_streams_bench() -> Any:
    """bench/streams.py as a module (its functions: cuda_case, cpu_case)."""
    path = Path(__file__).with_name("streams.py")
    spec = importlib.util.spec_from_file_location("bench_streams", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


STREAMS_LABELS = {"eager_s": "eager", "compile_reduce_overhead_s": "reduce-overhead",
                  "cuda_graph_single_stream_s": "graph-1", "cuda_graph_multi_stream_s": "graph-N",
                  "stream_executor_s": "executor"}
"""Short names of bench/streams.py's timings in the printed lines."""


def streams_line(case: dict[str, Any]) -> str:
    if case["status"] != "ok":
        return f"strm {case['net']:16s} {case['status'][:110]}"
    times = " ".join(f"{STREAMS_LABELS.get(k, k[:-2])} {v * 1e3:.3f}" for k, v in case.items()
                     if k.endswith("_s") and isinstance(v, float) and k != "wall_s")
    return f"strm {case['net']:16s} b {case['batch']} ms: {times}"


def streams_section(args: argparse.Namespace, device: torch.device, rec: Recorder,
                    budget: Budget) -> None:
    module = load_streams_bench()
    from meshmorph.demos.nets import NETS

    nets = list(NETS)[:1] if args.quick or device.type == "cpu" else list(NETS)
    previous = 0.0
    with tempfile.TemporaryDirectory(prefix="gpu-suite-streams-") as traces:
        trace_dir = Path(traces)
        for name in nets:
            if not budget.allows(max(10.0, 1.2 * previous)):
                rec.add("streams", {"net": name, "status": "skipped: budget"},
                        f"strm {name:16s} skipped: budget")
                continue
            started = time.perf_counter()
            try:
                if device.type == "cuda":
                    case = module.cuda_case(name, 1, 5, 10 if args.quick else 20, trace_dir)
                else:
                    case = module.cpu_case(name, 1, 1, 2)
                case = {"status": "ok", **case}
            except Exception as exc:
                case = {"net": name, "batch": 1, **error_record(exc)}
            previous = time.perf_counter() - started
            case["wall_s"] = previous
            release(device)
            rec.add("streams", case, streams_line(case))


# --- summary -------------------------------------------------------------------------------------
def _fmt(value: Any, spec: str, scale: float = 1.0) -> str:
    if isinstance(value, (int, float)):
        return format(value * scale, spec)
    width = spec.split(".")[0]
    return format("-", f">{width}") if width.isdigit() else "-"


def ceilings_summary(cases: list[dict[str, Any]]) -> list[str]:
    """A few lines: the single figures, then one line of GEMM TFLOP/s per model."""
    single, gemms, failed = [], {}, []
    for c in cases:
        if c.get("status") != "ok":
            failed.append(f"{c['name']}: {str(c.get('status'))[:60]}")
        elif "gemm" in c:
            model, label, kind = c["gemm"]
            gemms.setdefault(model, {}).setdefault(label, {})[kind] = c["tflops"]
        elif "tflops" in c:
            single.append(f"{c['name']} {c['tflops']:.0f} TF/s")
        elif "gbps" in c:
            single.append(f"{c['name']} {c['gbps']:.0f} GB/s")
        elif "backend" in c:
            single.append(f"{c['name']}: {c['backend']}")
    lines = ["ceil " + " | ".join(single[i:i + 4]) for i in range(0, len(single), 4)]
    for model, labels in gemms.items():
        kinds = "/".join(next(iter(labels.values())))
        lines.append(f"ceil gemm {model} TF/s ({kinds}): " + "  ".join(
            f"{label} " + "/".join(f"{v:.0f}" for v in rates.values())
            for label, rates in labels.items()))
    if failed:
        lines.append(f"ceil {len(failed)} not ok, first: {failed[0]}")
    return lines


def summary_table(data: dict[str, Any]) -> list[str]:
    sections = data["sections"]
    lines = [f"== summary: {data['meta']['device']}, torch {data['meta']['torch']}, "
             f"wall {time.perf_counter() - STARTED:.0f} s =="]
    for name, section in sections.items():
        if section.get("status") not in ("ok", "running"):
            lines.append(f"section {name}: {section.get('status')}")
    step = sections.get("step", {}).get("cases", [])
    if step:
        lines.append(f"{'model':12s} {'mode':7s} {'b':>2s} {'step ms':>8s} {'min-max':>11s} "
                     f"{'MFU':>6s} {'pred ms':>8s} {'p/m':>5s} {'alloc':>6s} {'resv':>6s} "
                     f"{'predGiB':>7s} {'+res':>6s} {'fb ms':>7s} {'opt ms':>7s} status")
        for c in step:
            ok = c.get("status") == "ok"
            span = (f"{c['measured_step_min_s'] * 1e3:.0f}-{c['measured_step_max_s'] * 1e3:.0f}"
                    if ok else "-")
            lines.append(
                f"{c.get('model', '?'):12s} {c.get('mode', '-'):7s} {c.get('micro_batch', 0):2d} "
                f"{_fmt(c.get('measured_step_s'), '8.1f', 1e3)} {span:>11s} "
                f"{_fmt(c.get('measured_mfu'), '6.1%')} "
                f"{_fmt(c.get('predicted_step_s'), '8.1f', 1e3)} {_fmt(c.get('ratio'), '5.2f')} "
                f"{_fmt(c.get('measured_case_peak_gib'), '6.1f')} "
                f"{_fmt(c.get('measured_reserved_gib'), '6.1f')} "
                f"{_fmt(c.get('predicted_allocated_gib'), '7.1f')} "
                f"{_fmt(c.get('predicted_peak_gib'), '6.1f')} "
                f"{_fmt(c.get('fwd_bwd_s'), '7.1f', 1e3)} {_fmt(c.get('optimizer_s'), '7.1f', 1e3)} "
                f"{'ok' if ok else str(c.get('status'))[:40]}")
        for c in step:
            if c.get("status") == "ok" and c.get("mode") == "compile" and "ratio" in c:
                mem = c.get("peak_ratio_allocated")
                checks = [f"MFU {c['measured_mfu']:.1%} {'PASS' if c['measured_mfu'] >= 0.45 else 'FAIL'}",
                          f"pred/meas step {c['ratio']:.2f} "
                          f"{'PASS' if abs(c['ratio'] - 1) <= 0.10 else 'FAIL'}"]
                if mem is not None:
                    checks.append(f"pred/meas peak {mem:.2f} {'PASS' if abs(mem - 1) <= 0.05 else 'FAIL'}"
                                  f" (with reserve / reserved {c['peak_ratio_reserved']:.2f})")
                lines.append(f"target {c['model']} compile b {c['micro_batch']}: "
                             + "; ".join(checks))
        for c in step:
            prof = c.get("profile")
            if prof:
                kinds = " ".join(f"{k} {v:.0f}" for k, v in prof["kernel_ms_per_step"].items())
                lines.append(f"kern {c['model']} {c['mode']} b {c['micro_batch']}: busy "
                             f"{prof['kernel_busy_ms_per_step']:.0f}/"
                             f"{prof['profiled_wall_ms_per_step']:.0f} ms: {kinds}")
        for mode, summ in sections.get("step", {}).get("summary", {}).items():
            if summ.get("cases_ok"):
                lines.extend(f"fit {mode}: {line}" for line in summary_lines(summ))
    lines.extend(ceilings_summary(sections.get("ceilings", {}).get("cases", [])))
    for c in sections.get("streams", {}).get("cases", []):
        lines.append(streams_line(c))
    return lines


# --- main ----------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="cuda (bf16, nccl) or cpu (fp32, gloo: a smoke test); default cuda "
                             "when available")
    parser.add_argument("--quick", action="store_true",
                        help="b 8 only, 4 timed steps, no fwd/bwd split, one streams net")
    OUTPUTS.add_args(parser)
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--models", nargs="+", default=None,
                        help=f"catalog models (default {' '.join(GPU_MODELS)}; "
                             f"{' '.join(CPU_MODELS)} with --device cpu)")
    parser.add_argument("--micro-batches", nargs="+", type=int, default=None,
                        help="eager micro-batch sizes b (default 8 4; 2 1 on cpu)")
    parser.add_argument("--compile-micro-batches", nargs="+", type=int, default=None,
                        help="compiled micro-batch sizes (default: every b that ran eagerly, "
                             "largest first; the largest alone with --quick)")
    parser.add_argument("--modes", default=None,
                        help="comma-separated eager,compile (default both on cuda, eager on cpu)")
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile backend of the compiled cases (default inductor)")
    parser.add_argument("--num-microbatches", type=int, default=NUM_MICROBATCHES)
    parser.add_argument("--seq-len", type=int, default=None,
                        help="sequence length (default 2048 on cuda; the catalog's on cpu)")
    parser.add_argument("--warmup", type=int, default=None, help="eager warm-up steps (2)")
    parser.add_argument("--compile-warmup", type=int, default=None,
                        help="compiled warm-up steps (3: eager capture step, compile, settle)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (8; 4 with --quick)")
    parser.add_argument("--split-repeats", type=int, default=None,
                        help="fwd+bwd-only and optimizer-only repeats (3; 0 with --quick)")
    parser.add_argument("--profile-steps", type=int, default=2,
                        help="steps of each case run again under torch.profiler for the kernel "
                             "time by kind (0: none; CUDA only; default 2)")
    parser.add_argument("--gpu", default=None, help="GPU catalog name for the prediction")
    parser.add_argument("--dtype", choices=("bf16", "fp8", "fp32"), default=None,
                        help="the step cases' plan dtype (default bf16 on cuda, fp32 on cpu; "
                             "fp8 trains the blocks' linears in float8 through torchao)")
    parser.add_argument("--fp8-scaling", default="tensorwise",
                        choices=("tensorwise", "rowwise", "rowwise_with_gw_hp"),
                        help="float8 recipe with --dtype fp8 (default tensorwise)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help=f"watchdog limit for the whole run (default {TOTAL_BUDGET_S:.0f} s)")
    args = parser.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("CUDA is not available here; use --device cpu for a smoke test")
    cuda = args.device == "cuda"
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {','.join(SECTIONS)}")
    args.modes = [m.strip() for m in (args.modes or ("eager,compile" if cuda else "eager"))
                  .split(",") if m.strip()]
    if set(args.modes) - {"eager", "compile"}:
        parser.error("--modes takes eager and/or compile")
    if args.models is None:
        args.models = list(GPU_MODELS if cuda else CPU_MODELS)
    if args.micro_batches is None:
        args.micro_batches = ([8] if args.quick else [8, 4]) if cuda else [2, 1]
    if args.seq_len is None and cuda:
        args.seq_len = 2048
    defaults = {"warmup": 2 if cuda else 1, "compile_warmup": 3 if cuda else 2,
                "steps": (4 if args.quick else 8) if cuda else 2,
                "split_repeats": (0 if args.quick else 3) if cuda else 1,
                "budget_s": TOTAL_BUDGET_S if cuda else TOTAL_BUDGET_S / 4}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.dtype is None:
        args.dtype = "bf16" if cuda else "fp32"
    if args.steps < 1 or args.warmup < 0 or args.compile_warmup < 0 or args.num_microbatches < 1:
        parser.error("need --steps >= 1, warm-ups >= 0 and --num-microbatches >= 1")
    return args


def start_watchdog(rec: Recorder, limit_s: float) -> threading.Timer:
    """At ``limit_s`` after the start: write the JSON and the summary, then end the process."""
    def fire() -> None:
        try:
            if rec.lock.acquire(timeout=10):
                try:
                    rec.data["aborted"] = f"wall-clock guard: {limit_s:.0f} s reached"
                    rec.save()
                finally:
                    rec.lock.release()
            emit(f"!! wall-clock guard: {limit_s:.0f} s reached; the case in flight is lost")
            for line in summary_table(rec.data):
                emit(line)
            emit(f"wrote {shown(rec.out)} (partial)")
        finally:
            sys.stdout.flush()
            os._exit(3)

    timer = threading.Timer(max(1.0, limit_s - (time.perf_counter() - STARTED)), fire)
    timer.daemon = True
    timer.start()
    return timer


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = args.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if not cuda:
        torch.set_num_threads(1)  # a smoke test: tiny ops only wait on more threads
    gpu_name = pick_gpu(device, args.gpu)
    dtype = args.dtype
    meta = describe(device, gpu_name, dtype)
    meta["args"] = {k: v for k, v in vars(args).items()}
    emit(f"gpu_suite: {meta['device']} (catalog '{gpu_name}'"
         + (f", cc {meta['capability']}, {meta['memory_gib']:.0f} GiB" if cuda else "")
         + f"), torch {meta['torch']}, CUDA {meta['cuda']}, triton {meta.get('triton', '-')}, "
         f"python {meta['python']}, {dtype}")
    emit("flags: " + ", ".join(f"{k}={v}" for k, v in meta["flags"].items()))
    emit(f"sections {','.join(args.sections)}; models {' '.join(args.models)}; b "
         f"{args.micro_batches}; modes {','.join(args.modes)}; {args.steps} timed steps; "
         f"budget {args.budget_s:.0f} s")
    rec = Recorder(OUTPUTS.path(args), meta)
    rec.save()
    watchdog = start_watchdog(rec, args.budget_s)
    run_end = STARTED + args.budget_s - 5.0
    scale = 1.0 if cuda else 0.25
    order = [s for s in SECTIONS if s in args.sections]
    runners: dict[str, Callable[[Budget], None]] = {
        "ceilings": lambda b: ceilings_section(args, device, rec, b),
        "step": lambda b: step_section(args, device, gpu_name, dtype, rec, b),  # inits dist
        "streams": lambda b: streams_section(args, device, rec, b),
    }
    try:
        for index, name in enumerate(order):
            reserve = sum(SECTION_BUDGET_S[s] * scale for s in order[index + 1:])
            budget = Budget(SECTION_BUDGET_S[name] * scale, run_end, min(reserve, 0.3 * args.budget_s))
            section = rec.section(name)
            started = time.perf_counter()
            try:
                runners[name](budget)
                section["status"] = "ok"
            except Exception as exc:
                section |= error_record(exc)
                emit(f"section {name}: {section['status']}")
            section["wall_s"] = time.perf_counter() - started
            release(device)
            rec.save()
    finally:
        with contextlib.suppress(Exception):
            if dist.is_initialized():
                dist.destroy_process_group()
    watchdog.cancel()
    rec.data["complete"] = True
    rec.save()
    for line in summary_table(rec.data):
        emit(line)
    emit(f"wrote {shown(rec.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
