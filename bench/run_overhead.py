"""Overhead of meshmorph's training engine against a hand-written DDP loop, and the step rate
of every layout of the equivalence matrix.

Section 1 (2 gloo processes on CPU): a small GPT, ``build_engine`` with dp=2 (zero 0) against a
plain ``DistributedDataParallel`` loop on the same model, data and arithmetic (micro-batch
accumulation under ``no_sync``, ``clip_grad_norm_``, AdamW, LambdaLR, the global mean loss
all-reduced). Steps alternate between the two so drift hits both alike; the figure is the ratio
of median step times after warm-up (target <= 1.05).
Section 2 (4 gloo processes): steps/s and tokens/s of each layout of tests/dist/test_equivalence.

Run: ``python bench/run_overhead.py [--steps N]``; writes bench/results/run_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "dist"))  # the spawn harness and the layout matrix

from spawn import spawn  # noqa: E402

OVERHEAD_SHAPE = dict(name="gpt-bench", arch="gpt", num_layers=4, hidden_size=128, num_heads=4,
                      vocab_size=256, seq_len=64)
"""The model of section 1: about 0.85 M parameters."""
GLOBAL_BATCH = 16
"""Sequences per step in section 1 (8 per rank, 2 micro-batches of 4)."""
WARMUP = 3
"""Untimed steps before measuring."""


def overhead_job(rank: int, world_size: int, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from meshmorph.run.config import OptimConfig
    from meshmorph.run.engine import build_engine
    from meshmorph.run.loss import token_cross_entropy
    from meshmorph.run.models import build_model
    from meshmorph.spec.plan import Plan
    from meshmorph.spec.transformer import TransformerShape, build_transformer

    spec = build_transformer(TransformerShape(**OVERHEAD_SHAPE))  # type: ignore[arg-type]
    optim = OptimConfig()
    m = 2
    plan = Plan(model=spec.name, seq_len=spec.seq_len, global_batch=GLOBAL_BATCH, dp=world_size,
                micro_batch=GLOBAL_BATCH // world_size // m, num_microbatches=m,
                dtype="fp32").with_even_stages(spec)
    engine = build_engine(spec, plan, optim, seed=0, device=torch.device("cpu"))

    ddp = DistributedDataParallel(build_model(spec, seed=0))
    opt = torch.optim.AdamW(ddp.parameters(), lr=optim.lr, betas=(optim.beta1, optim.beta2),
                            eps=optim.eps, weight_decay=optim.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: optim.lr_at(s) / optim.lr)

    def ddp_step(tokens: torch.Tensor) -> float:
        opt.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for i, mb in enumerate(tokens.chunk(m)):
            context = ddp.no_sync() if i < m - 1 else torch.enable_grad()
            with context:
                loss = token_cross_entropy(ddp(mb[:, :-1]), mb[:, 1:])
                (loss / m).backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), optim.grad_clip)
        opt.step()
        sched.step()
        dist.all_reduce(total)
        return float(total) / (m * world_size)

    gen = torch.Generator().manual_seed(0)
    share = GLOBAL_BATCH // world_size
    times: dict[str, list[float]] = {"meshmorph": [], "ddp": []}
    losses: dict[str, list[float]] = {"meshmorph": [], "ddp": []}
    for step in range(WARMUP + steps):
        batch = torch.randint(0, spec.vocab_size, (GLOBAL_BATCH, spec.seq_len + 1), generator=gen)
        mine = batch[rank * share:(rank + 1) * share]
        for name, fn in (("meshmorph", engine.step), ("ddp", ddp_step)):
            dist.barrier()
            start = time.perf_counter()
            loss = fn(mine)
            elapsed = time.perf_counter() - start
            if step >= WARMUP:
                times[name].append(elapsed)
            losses[name].append(loss)
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "losses": losses}))


def matrix_job(rank: int, world_size: int, steps: int, out: str) -> None:
    import gc

    import torch
    import torch.distributed as dist
    from test_equivalence import OPTIM, SEED, layouts

    from meshmorph.run.engine import build_engine

    results = {}
    for layout in layouts():
        plan = layout.plan
        engine = build_engine(layout.model, plan, OPTIM, seed=SEED, device=torch.device("cpu"))
        gen = torch.Generator().manual_seed(0)
        share = plan.global_batch // plan.dp
        times = []
        for step in range(WARMUP + steps):
            batch = torch.randint(0, layout.model.vocab_size, (plan.global_batch, plan.seq_len + 1),
                                  generator=gen)
            dist.barrier()
            start = time.perf_counter()
            engine.step(batch[engine.dp_rank * share:(engine.dp_rank + 1) * share])
            if step >= WARMUP:
                times.append(time.perf_counter() - start)
        median = statistics.median(times)
        results[layout.name] = {"median_step_s": median, "steps_per_s": 1 / median,
                                "tokens_per_s": plan.global_batch * plan.seq_len / median,
                                "model": layout.model.name, "params": layout.model.num_params}
        del engine
        gc.collect()
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per layout (section 1)")
    parser.add_argument("--matrix-steps", type=int, default=6, help="timed steps (section 2)")
    parser.add_argument("--skip-matrix", action="store_true", help="section 1 only")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        overhead_file, matrix_file = f"{tmp}/overhead.json", f"{tmp}/matrix.json"
        start = time.perf_counter()
        spawn(overhead_job, 2, (args.steps, overhead_file), timeout_s=240)
        overhead = json.loads(Path(overhead_file).read_text())
        matrix = {}
        if not args.skip_matrix:
            spawn(matrix_job, 4, (args.matrix_steps, matrix_file), timeout_s=300)
            matrix = json.loads(Path(matrix_file).read_text())
        wall = time.perf_counter() - start
    med = {name: statistics.median(ts) for name, ts in overhead["times"].items()}
    ratio = med["meshmorph"] / med["ddp"]
    loss_gap = max(abs(a - b) for a, b in zip(*overhead["losses"].values(), strict=True))
    print(f"section 1: 2 gloo ranks, {OVERHEAD_SHAPE['name']} (4 x 128, s {OVERHEAD_SHAPE['seq_len']})"
          f", global batch {GLOBAL_BATCH}, {args.steps} timed steps after {WARMUP} warm-up")
    for name, value in med.items():
        print(f"  {name:10s} median step {value * 1e3:8.1f} ms   {1 / value:6.2f} steps/s")
    print(f"  ratio meshmorph / ddp = {ratio:.3f} (target <= 1.05); largest loss gap {loss_gap:.2e}")
    print("section 2: equivalence matrix on 4 gloo ranks")
    for name, row in matrix.items():
        print(f"  {name:26s} {row['steps_per_s']:7.2f} steps/s  {row['tokens_per_s']:9.0f} tokens/s")
    result = {"overhead": {"model": OVERHEAD_SHAPE, "global_batch": GLOBAL_BATCH,
                           "timed_steps": args.steps, "warmup_steps": WARMUP,
                           "median_step_s": med, "ratio": ratio, "max_loss_gap": loss_gap,
                           "step_times_s": overhead["times"]},
              "matrix": matrix, "wall_s": wall,
              "torch_threads_per_rank": 1}
    out = ROOT / "bench" / "results" / "run_overhead.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)} ({wall:.0f} s)")


if __name__ == "__main__":
    main()
