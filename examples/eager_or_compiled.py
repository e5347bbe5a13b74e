"""How running each block under torch.compile changes a plan's step time and memory.

The cost model prices a Plan as it runs: eager blocks (``Plan.compile`` false, the default) keep
their norms' fp32 inputs and one 16-bit copy of a norm's output per projection and launch a
kernel per elementwise op; compiled blocks fuse those kernels and keep less. This prints both
for one plan, per block and for the step, and says where each byte goes. Planning only: no torch.

    python examples/eager_or_compiled.py [--model llama3.2-1b] [--gpu h200] [--micro-batch 8]
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from meshmorph.cost.estimate import GIB
from meshmorph.cost.model import CostModel
from meshmorph.spec import load_model
from meshmorph.spec.cluster import parse_cluster
from meshmorph.spec.model import Recompute
from meshmorph.spec.plan import Plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3.2-1b")
    parser.add_argument("--gpu", default="h200")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=8)
    args = parser.parse_args()
    model = load_model(args.model, args.seq_len)
    cost = CostModel(model, parse_cluster(f"{args.gpu}:1x1"))
    eager = Plan(model=args.model, seq_len=args.seq_len, global_batch=2 * args.micro_batch,
                 micro_batch=args.micro_batch, num_microbatches=2).with_even_stages(model)
    tokens, h = args.micro_batch * args.seq_len, model.hidden_size
    print(f"{args.model} on one {args.gpu}, 2 micro-batches of {args.micro_batch} x "
          f"{args.seq_len} tokens, bf16")
    for plan in (eager, replace(eager, compile=True)):
        estimate = cost.estimate(plan)
        block = cost.coster(plan).layer(1, cost.default_gpu(), args.micro_batch, 1, False,
                                        Recompute.NONE)
        memory = estimate.memory[0]
        print(f"  {'compiled' if plan.compile else 'eager':8s}  step {estimate.step_time_s:.3f} s"
              f"  MFU {estimate.mfu:.1%}  peak {memory.total / GIB:.1f} GiB"
              f" (activations {memory.activations / GIB:.1f} GiB;"
              f" a block keeps {block.activation_bytes / tokens / h:.0f} h bytes per token)")


if __name__ == "__main__":
    main()
