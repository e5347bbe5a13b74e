"""What float8 linear layers (dtype fp8) buy one plan, per scaling recipe, large and small.

dtype ``fp8`` prices torchao's float8 training as torchtitan runs it: each transformer block's
GEMMs multiply float8 operands at the GPU's fp8 peak, each operand is scaled and cast on the
fly (memory-bound), the head, attention and everything kept stay bf16 (cost/fp8.py). Large
GEMMs gain up to 2x; in small ones the casts take back most of the gain. This prints the step, MFU (against the bf16
peak, as torchtitan reports it) and one block's forward for bf16 and each recipe, for a large
model and a small one. Planning only: no torch. ``meshmorph run`` trains fp8 plans and jobs
(examples/jobs/text-file-fp8.toml: on a CPU, without fp8 tensor cores, it trains but gains
nothing; this script prices GPUs).

    python examples/fp8_or_bf16.py [--gpu h100] [--seq-len 8192] [--micro-batch 1]
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from meshmorph.cost.model import CostModel
from meshmorph.spec import load_model
from meshmorph.spec.cluster import parse_cluster
from meshmorph.spec.model import Recompute
from meshmorph.spec.plan import Fp8Scaling, Plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--micro-batch", type=int, default=1)
    args = parser.parse_args()
    for name in ("llama3-8b", "llama3.2-1b"):
        model = load_model(name, args.seq_len)
        cost = CostModel(model, parse_cluster(f"{args.gpu}:1x8"))
        bf16 = Plan(model=name, seq_len=args.seq_len, global_batch=8 * args.micro_batch, dp=8,
                    zero=3, micro_batch=args.micro_batch, num_microbatches=1, compile=True,
                    ).with_even_stages(model, Recompute.SELECTIVE)
        base = cost.estimate(bf16).step_time_s
        print(f"{name}, FSDP over 8 {args.gpu}, micro-batch {args.micro_batch} x "
              f"{args.seq_len}, compiled, selective recompute")
        plans = [bf16] + [replace(bf16, dtype="fp8", fp8_scaling=s) for s in Fp8Scaling]
        for plan in plans:
            estimate = cost.estimate(plan)
            block = cost.coster(plan).layer(1, cost.default_gpu(), args.micro_batch, 1, False,
                                            Recompute.NONE)
            label = "bf16" if plan.dtype == "bf16" else f"fp8 {plan.fp8_scaling}"
            print(f"  {label:22s} step {estimate.step_time_s:.3f} s ({base / estimate.step_time_s:.2f}x)"
                  f"  MFU {estimate.mfu:.1%}  block forward {block.fwd_s * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
