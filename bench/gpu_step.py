"""Measured training step time of meshmorph's engine on ONE CUDA GPU, beside the cost model's
prediction for the same plan.

Each case is a catalog GPT trained by ``build_engine`` under a pure single-GPU plan (tp = pp =
dp = 1, zero 0, bf16, no recompute, 2 micro-batches of b sequences). The script initialises a
one-rank process group itself (nccl; gloo with ``--device cpu``), times ``--steps`` steps after
``--warmup`` untimed ones with the device synchronised around each step, and puts the median
step time, the MFU (model FLOPs / step time / dense bf16 peak, the numerator the estimate uses)
and ``torch.cuda.max_memory_allocated`` beside ``CostModel.estimate``'s step time, MFU and
peak memory. A case the estimate says does not fit the GPU is skipped; an out-of-memory error is
recorded, not raised. At the end: the median and largest |predicted / measured - 1|, and the
matmul-efficiency ceiling (``CostCoefficients.matmul_efficiency``, or a Profile's
``matmul_efficiency[gpu]``) that would make the predictions match best.

Run on a GPU machine, from the repository root:

    PYTHONPATH=src python bench/gpu_step.py                # gpt3-125m..1.3b, b 1 and 4
    PYTHONPATH=src python bench/gpu_step.py --gpu h100 --models gpt3-125m --micro-batches 4

Smoke test without a GPU (fp32, gloo, the ``cpu`` catalog entry as the "GPU"):

    python bench/gpu_step.py --device cpu --models gpt-tiny --seq-len 128 --steps 2 --warmup 1 \
        --out /tmp/gpu_step_cpu.json

Writes bench/results/gpu_step.json (or --out): device, torch version, one record per case.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshmorph.cost.coefficients import CostCoefficients
from meshmorph.cost.estimate import GIB, Estimate
from meshmorph.cost.model import CostModel
from meshmorph.run.config import OptimConfig
from meshmorph.run.engine.train_engine import TrainEngine, build_engine
from meshmorph.spec import ModelSpec, gpu, load_model, parse_cluster
from meshmorph.spec.plan import Plan

ROOT = Path(__file__).resolve().parents[1]
GPU_MODELS = ("gpt3-125m", "gpt3-350m", "gpt3-760m", "gpt3-1.3b")
"""Default cases on CUDA."""
CPU_MODELS = ("gpt-tiny",)
"""Default cases with --device cpu."""
NUM_MICROBATCHES = 2
"""Micro-batches per step (gradient accumulation) unless --num-microbatches says otherwise."""
SEED = 0
"""Weights and token batches."""


# --- setup -------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (bf16, nccl) or cpu (fp32, gloo: a smoke test)")
    parser.add_argument("--gpu", default=None,
                        help="GPU catalog name for the prediction (default: from the CUDA device "
                             "name, h100 or h200; 'cpu' with --device cpu)")
    parser.add_argument("--models", nargs="+", default=None,
                        help=f"catalog models (default {' '.join(GPU_MODELS)}; "
                             f"{' '.join(CPU_MODELS)} with --device cpu)")
    parser.add_argument("--micro-batches", nargs="+", type=int, default=[1, 4],
                        help="micro-batch sizes b to run (default 1 4)")
    parser.add_argument("--num-microbatches", type=int, default=NUM_MICROBATCHES,
                        help="micro-batches per step (default 2)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="sequence length (default: the catalog's, 2048 for gpt3-*)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per case")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per case")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gpu_step.json",
                        help="JSON output (default bench/results/gpu_step.json)")
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.num_microbatches < 1:
        parser.error("need --steps >= 1, --warmup >= 0 and --num-microbatches >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("CUDA is not available here; use --device cpu for a smoke test")
    if args.models is None:
        args.models = list(GPU_MODELS if args.device == "cuda" else CPU_MODELS)
    return args


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
    for key in ("H200", "H100"):  # "H100" is no substring of "H200", but test H200 first anyway
        if key in name:
            return key.lower()
    raise SystemExit(f"cannot tell the catalog GPU of {device_name(device)!r}; pass --gpu NAME "
                     "(see `meshmorph gpus` or meshmorph/spec/gpus.py)")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def init_single_rank(device: torch.device) -> None:
    """A one-rank default process group in this process (no torchrun)."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- plan and prediction -----------------------------------------------------------------------
def make_plan(spec: ModelSpec, micro_batch: int, num_microbatches: int, dtype: str) -> Plan:
    """tp = pp = dp = 1, zero 0, no recompute: the whole model on one device."""
    return Plan(model=spec.name, seq_len=spec.seq_len, global_batch=micro_batch * num_microbatches,
                micro_batch=micro_batch, num_microbatches=num_microbatches, zero=0,
                dtype=dtype).with_even_stages(spec)


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


def _fit_terms(cases: list[dict[str, Any]]) -> tuple[list[float], list[float], list[float]]:
    """For the cases that ran: a_i = A_i / M_i, r_i = 1 - B_i / M_i and 1 / M_i, where A_i, B_i
    are the case's time_split_s and M_i its measured median step time."""
    done = [c for c in cases if c["status"] == "ok"]
    a = [c["time_split_s"][0] / c["measured_step_s"] for c in done]
    r = [1 - c["time_split_s"][1] / c["measured_step_s"] for c in done]
    inv = [1 / c["measured_step_s"] for c in done]
    return a, r, inv


def fit_ceiling(cases: list[dict[str, Any]]) -> float | None:
    """The ceiling c minimising sum_i (predicted_i(c) / measured_i - 1)^2 (relative errors, so the
    short steps of small models weigh as much as the long ones of big models).

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
    solved by the 2 x 2 normal equations. Shows how much of the gap is a per-step cost (kernel
    launches, host syncs) that no matmul ceiling models."""
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


# --- measurement -------------------------------------------------------------------------------
def time_steps(engine: TrainEngine, plan: Plan, vocab: int, device: torch.device, warmup: int,
               steps: int) -> tuple[list[float], list[float]]:
    """Step times (s) of the timed steps and the losses of all steps; a fresh random batch of
    tokens [global_batch, seq_len + 1] (inputs and shifted labels) on the device for each."""
    generator = torch.Generator(device=device).manual_seed(SEED)
    shape = (plan.global_batch, plan.seq_len + 1)
    times, losses = [], []
    for step in range(warmup + steps):
        tokens = torch.randint(0, vocab, shape, generator=generator, device=device)
        synchronize(device)
        start = time.perf_counter()
        losses.append(engine.step(tokens))
        synchronize(device)
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return times, losses


def measure(spec: ModelSpec, plan: Plan, device: torch.device, warmup: int,
            steps: int) -> dict[str, Any]:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    engine = build_engine(spec, plan, OptimConfig(), seed=SEED, device=device)
    build_s = time.perf_counter() - started
    times, losses = time_steps(engine, plan, spec.vocab_size, device, warmup, steps)
    row: dict[str, Any] = {"build_s": build_s, "step_times_s": times, "losses": losses,
                           "measured_step_s": statistics.median(times)}
    if device.type == "cuda":
        row["measured_peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        row["measured_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
    return row


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_case(name: str, micro_batch: int, args: argparse.Namespace, device: torch.device,
             gpu_name: str, dtype: str) -> dict[str, Any]:
    spec = load_model(name, args.seq_len)
    plan = make_plan(spec, micro_batch, args.num_microbatches, dtype)
    est = predict(spec, plan, gpu_name)
    tokens = plan.global_batch * plan.seq_len
    model_flops = tokens * spec.model_flops_per_token()  # the estimate's MFU numerator
    peak = gpu(gpu_name).peak_flops(dtype)
    memory = est.memory[0]
    case: dict[str, Any] = {
        "model": name, "params": spec.num_params, "seq_len": plan.seq_len,
        "micro_batch": micro_batch, "num_microbatches": plan.num_microbatches,
        "global_batch": plan.global_batch, "dtype": dtype, "gpu": gpu_name,
        "tokens_per_step": tokens, "model_flops_per_step": model_flops, "peak_flops": peak,
        "predicted_step_s": est.step_time_s, "predicted_mfu": est.mfu,
        "predicted_peak_gib": memory.total / GIB,
        "predicted_peak_gib_without_reserve": (memory.total - memory.reserved) / GIB,
        "predicted_fits": est.fits, "predicted_breakdown_s": dict(est.breakdown_s),
        "time_split_s": time_split(spec, plan, gpu_name), "plan": plan.to_dict(),
    }
    if not est.fits:
        case["status"] = "skipped: does not fit per the estimate"
        return case
    try:
        case |= measure(spec, plan, device, args.warmup, args.steps)
    except torch.cuda.OutOfMemoryError as exc:
        case["status"] = f"oom: {str(exc).splitlines()[0]}"
        return case
    measured = case["measured_step_s"]
    case |= {"status": "ok", "ratio": est.step_time_s / measured,
             "measured_mfu": model_flops / measured / peak,
             "measured_tokens_per_s": tokens / measured}
    return case


# --- report ------------------------------------------------------------------------------------
def case_line(case: dict[str, Any]) -> str:
    head = f"{case['model']:10s} b {case['micro_batch']:2d}"
    if case["status"] != "ok":
        return (f"{head}  {case['status']} (predicted {case['predicted_step_s'] * 1e3:.1f} ms, "
                f"{case['predicted_peak_gib']:.1f} GiB)")
    gib = case.get("measured_peak_gib")
    measured_gib = f"{gib:6.2f}" if gib is not None else "   n/a"
    return (f"{head}  step {case['measured_step_s'] * 1e3:9.1f} ms  predicted "
            f"{case['predicted_step_s'] * 1e3:9.1f} ms  pred/meas {case['ratio']:5.2f}  "
            f"MFU {case['measured_mfu']:6.1%} (pred {case['predicted_mfu']:6.1%})  "
            f"peak {measured_gib} GiB (pred {case['predicted_peak_gib']:6.2f}, "
            f"{case['predicted_peak_gib_without_reserve']:.2f} w/o reserve)")


def summarise(cases: list[dict[str, Any]]) -> dict[str, Any]:
    errors = [abs(c["ratio"] - 1) for c in cases if c["status"] == "ok"]
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


def run_all(args: argparse.Namespace, device: torch.device, gpu_name: str, dtype: str,
            emit: Callable[[str], None]) -> list[dict[str, Any]]:
    cases = []
    for name in args.models:
        for micro_batch in args.micro_batches:
            case = run_case(name, micro_batch, args, device, gpu_name, dtype)
            release(device)
            cases.append(case)
            emit(case_line(case))
    return cases


def main() -> None:
    args = parse_args()
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" \
        else torch.device("cpu")
    gpu_name = pick_gpu(device, args.gpu)
    dtype = "bf16" if device.type == "cuda" else "fp32"
    init_single_rank(device)
    started = time.perf_counter()
    print(f"{device_name(device)} (catalog '{gpu_name}'), torch {torch.__version__}, {dtype}, "
          f"{args.num_microbatches} micro-batches, {args.steps} timed steps after "
          f"{args.warmup} warm-up, median step")
    try:
        cases = run_all(args, device, gpu_name, dtype, lambda line: print(line, flush=True))
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    summary = summarise(cases)
    for line in summary_lines(summary):
        print(line)
    result = {"device": device_name(device), "device_type": device.type, "gpu": gpu_name,
              "torch": torch.__version__, "cuda": torch.version.cuda,
              "python": platform.python_version(), "dtype": dtype,
              "warmup_steps": args.warmup, "timed_steps": args.steps,
              "cases": cases, "summary": summary, "wall_s": time.perf_counter() - started}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
