"""Measured training step time of meshmorph's engine on ONE CUDA GPU, beside the cost model's
prediction for the same plan (eager only; bench/gpu_suite.py runs the same cases with
torch.compile too, plus raw ceilings and the streams nets).

Each case is a catalog GPT trained by ``build_engine`` under a pure single-GPU plan (tp = pp =
dp = 1, zero 0, bf16, no recompute, 2 micro-batches of b sequences). The script initialises a
one-rank process group itself (nccl; gloo with ``--device cpu``), times ``--steps`` steps after
``--warmup`` untimed ones with the device synchronised around each step, and puts the median
step time, the MFU (model FLOPs / step time / dense bf16 peak, the numerator the estimate uses)
and ``torch.cuda.max_memory_allocated`` beside ``CostModel.estimate``'s step time, MFU and
peak memory. An out-of-memory error is recorded, not raised. At the end: the median and largest
|predicted / measured - 1|, and the matmul-efficiency ceiling (``CostCoefficients.
matmul_efficiency``, or a Profile's ``matmul_efficiency[gpu]``) that would make the predictions
match best. The helpers live in bench/gpu_suite.py; each model is built once and every
micro-batch size gets a fresh engine over its parts.

Run on a GPU machine, from the repository root:

    PYTHONPATH=src python bench/gpu_step.py                # gpt3-125m..1.3b, b 1 and 4
    PYTHONPATH=src python bench/gpu_step.py --gpu h100 --models gpt3-125m --micro-batches 4

Smoke test without a GPU (fp32, gloo, the ``cpu`` catalog entry as the "GPU"):

    python bench/gpu_step.py --device cpu --models gpt-tiny --seq-len 128 --steps 2 --warmup 1 \\
        --out /tmp/gpu_step_cpu.json

Writes bench/results/latest/gpu_step.json (``--out PATH`` to choose, ``--update`` for the committed
bench/results/gpu_step.json): device, torch version, one record per case.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import time

import torch
import torch.distributed as dist

from gpu_suite import (
    StepSection,
    device_name,
    init_single_rank,
    pick_gpu,
    summarise,
    summary_lines,
)
from results_path import Outputs, wrote

OUTPUTS = Outputs("bench/results/gpu_step.json")

GPU_MODELS = ("gpt3-125m", "gpt3-350m", "gpt3-760m", "gpt3-1.3b")
"""Default cases on CUDA."""
CPU_MODELS = ("gpt-tiny",)
"""Default cases with --device cpu."""


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
    parser.add_argument("--num-microbatches", type=int, default=2,
                        help="micro-batches per step (default 2)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="sequence length (default: the catalog's, 2048 for gpt3-*)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per case")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per case")
    OUTPUTS.add_args(parser)
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.num_microbatches < 1:
        parser.error("need --steps >= 1, --warmup >= 0 and --num-microbatches >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("CUDA is not available here; use --device cpu for a smoke test")
    if args.models is None:
        args.models = list(GPU_MODELS if args.device == "cuda" else CPU_MODELS)
    # the suite's step-section settings: eager only, no fwd/bwd split
    args.modes, args.split_repeats = ["eager"], 0
    args.compile_micro_batches, args.compile_backend, args.compile_warmup = None, "inductor", 0
    return args


def main() -> None:
    args = parse_args()
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" \
        else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)  # a smoke test: tiny ops only wait on more threads
    gpu_name = pick_gpu(device, args.gpu)
    dtype = "bf16" if device.type == "cuda" else "fp32"
    init_single_rank(device)
    started = time.perf_counter()
    print(f"{device_name(device)} (catalog '{gpu_name}'), torch {torch.__version__}, {dtype}, "
          f"{args.num_microbatches} micro-batches, {args.steps} timed steps after "
          f"{args.warmup} warm-up, median step")
    try:
        cases = StepSection(args, device, gpu_name, dtype, rec=None, budget=None).run()
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
    out = OUTPUTS.path(args)
    out.write_text(json.dumps(result, indent=2, default=repr) + "\n")
    wrote(out)


if __name__ == "__main__":
    main()
