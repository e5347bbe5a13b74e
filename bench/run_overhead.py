"""Overhead of meshmorph's training engine against hand-written torch, family by family, and
the step rate of every layout of the equivalence matrix.

Section 1 (2 gloo processes on CPU): a small GPT trained by ``build_engine`` and by the
hand-written torch loop of the same family (bench/torch_baselines.py: DDP; ZeRO-1 as
Megatron-LM's distributed optimizer written with FSDP2; FSDP2 ZeRO-3;
tensor parallelism with DTensor; a 1F1B pipeline with torch.distributed.pipelining) on the same
model, data and arithmetic. Steps alternate between the two so drift hits both alike; each
figure is the ratio of median step times after warm-up (target <= 1.05 per family), beside the
largest loss difference (same numbers expected up to reassociation).
Section 2 (4 gloo processes): steps/s and tokens/s of each layout of tests/dist/test_equivalence.

Run: ``python bench/run_overhead.py [--steps N] [--skip-matrix]``; writes
bench/results/latest/run_overhead.json (``--out PATH`` to choose, ``--update`` for the committed
bench/results/run_overhead.json; ``--skip-matrix`` keeps the committed file's section 2).
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
sys.path.insert(0, str(ROOT))  # tests.helpers: the spawn harness and the layout matrix
sys.path.insert(0, str(ROOT / "bench"))

from tests.helpers.spawn import spawn  # noqa: E402

from results_path import Outputs, shown  # noqa: E402

OUTPUTS = Outputs("bench/results/run_overhead.json")

OVERHEAD_SHAPE = dict(name="gpt-bench", arch="gpt", num_layers=4, hidden_size=128, num_heads=4,
                      vocab_size=256, seq_len=64)
"""The model of section 1: about 0.85 M parameters."""
GLOBAL_BATCH = 16
"""Sequences per step in section 1."""
MICROBATCHES = 2
"""Micro-batches per step in section 1."""
WARMUP = 3
"""Untimed steps before measuring."""
FAMILIES = ("ddp", "zero1", "fsdp_zero3", "tp", "pp")
"""The families of section 1, each on 2 ranks."""


def _family_plan(family: str, spec, world_size: int):  # type: ignore[no-untyped-def]
    from meshmorph.schedule.table import Schedule
    from meshmorph.spec.plan import Plan

    dp = 1 if family in ("tp", "pp") else world_size
    kw = {"ddp": {}, "zero1": {"zero": 1}, "fsdp_zero3": {"zero": 3}, "tp": {"tp": world_size},
          "pp": {"pp": world_size, "schedule": Schedule.ONE_F_ONE_B}}[family]
    return Plan(model=spec.name, seq_len=spec.seq_len, global_batch=GLOBAL_BATCH, dp=dp,
                micro_batch=GLOBAL_BATCH // dp // MICROBATCHES, num_microbatches=MICROBATCHES,
                dtype="fp32", **kw).with_even_stages(spec)


def overhead_job(rank: int, world_size: int, steps: int, out: str) -> None:
    import gc

    import torch
    import torch.distributed as dist

    import torch_baselines
    from meshmorph.run.config import OptimConfig
    from meshmorph.run.engine.train_engine import build_engine
    from meshmorph.spec.transformer import TransformerShape, build_transformer

    spec = build_transformer(TransformerShape(**OVERHEAD_SHAPE))  # type: ignore[arg-type]
    optim = OptimConfig()
    results = {}
    for family in FAMILIES:
        plan = _family_plan(family, spec, world_size)
        engine = build_engine(spec, plan, optim, seed=0, device=torch.device("cpu"))
        if family == "pp":
            torch_step = torch_baselines.pp_step(spec, optim, MICROBATCHES, 0, plan.micro_batch)
        else:
            torch_step = getattr(torch_baselines, {"ddp": "ddp_step", "zero1": "zero1_step",
                                                   "fsdp_zero3": "fsdp_step",
                                                   "tp": "tp_step"}[family])(spec, optim,
                                                                            MICROBATCHES, 0)
        gen = torch.Generator().manual_seed(0)
        share = plan.global_batch // plan.dp
        times: dict[str, list[float]] = {"meshmorph": [], "torch": []}
        losses: dict[str, list[float]] = {"meshmorph": [], "torch": []}
        for step in range(WARMUP + steps):
            batch = torch.randint(0, spec.vocab_size, (GLOBAL_BATCH, spec.seq_len + 1),
                                  generator=gen)
            mine = batch[engine.dp_rank * share:(engine.dp_rank + 1) * share]
            # alternate which one goes first, so neither always runs on a warmer cache
            order = [("meshmorph", engine.step), ("torch", torch_step)]
            for name, fn in order if step % 2 == 0 else order[::-1]:
                dist.barrier()
                start = time.perf_counter()
                loss = fn(mine)
                elapsed = time.perf_counter() - start
                if step >= WARMUP:
                    times[name].append(elapsed)
                losses[name].append(loss)
        results[family] = {"times": times, "losses": losses}
        del engine, torch_step
        gc.collect()
        dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def matrix_job(rank: int, world_size: int, steps: int, out: str) -> None:
    import gc

    import torch
    import torch.distributed as dist
    from tests.helpers.matrix import layouts
    from tests.helpers.oracle import OPTIM, SEED

    from meshmorph.run.engine.train_engine import build_engine

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
    parser.add_argument("--steps", type=int, default=20, help="timed steps per family (section 1)")
    parser.add_argument("--matrix-steps", type=int, default=6, help="timed steps (section 2)")
    parser.add_argument("--skip-matrix", action="store_true",
                        help="section 1 only (the JSON keeps the last recorded section 2)")
    OUTPUTS.add_args(parser)
    args = parser.parse_args()
    out = OUTPUTS.path(args)
    with tempfile.TemporaryDirectory() as tmp:
        overhead_file, matrix_file = f"{tmp}/overhead.json", f"{tmp}/matrix.json"
        start = time.perf_counter()
        spawn(overhead_job, 2, (args.steps, overhead_file), timeout_s=900)
        overhead = json.loads(Path(overhead_file).read_text())
        matrix = {}
        previous = OUTPUTS.committed_path()
        if args.skip_matrix and previous.exists():  # keep the last recorded section 2
            matrix = json.loads(previous.read_text()).get("matrix", {})
        if not args.skip_matrix:
            spawn(matrix_job, 4, (args.matrix_steps, matrix_file), timeout_s=600)
            matrix = json.loads(Path(matrix_file).read_text())
        wall = time.perf_counter() - start
    print(f"section 1: 2 gloo ranks, {OVERHEAD_SHAPE['name']} (4 x 128, s {OVERHEAD_SHAPE['seq_len']})"
          f", global batch {GLOBAL_BATCH} in {MICROBATCHES} micro-batches, {args.steps} timed "
          f"steps after {WARMUP} warm-up")
    families = {}
    for family, data in overhead.items():
        med = {name: statistics.median(ts) for name, ts in data["times"].items()}
        ratio = med["meshmorph"] / med["torch"]
        gap = max(abs(a - b) for a, b in zip(*data["losses"].values(), strict=True))
        print(f"  {family:11s} meshmorph {med['meshmorph'] * 1e3:7.1f} ms   torch "
              f"{med['torch'] * 1e3:7.1f} ms   ratio {ratio:.3f} (target <= 1.05)   "
              f"largest loss gap {gap:.2e}")
        families[family] = {"median_step_s": med, "ratio": ratio, "max_loss_gap": gap,
                            "step_times_s": data["times"]}
    print("section 2: equivalence matrix on 4 gloo ranks")
    for name, row in matrix.items():
        print(f"  {name:26s} {row['steps_per_s']:7.2f} steps/s  {row['tokens_per_s']:9.0f} tokens/s")
    result = {"overhead": {"model": OVERHEAD_SHAPE, "global_batch": GLOBAL_BATCH,
                           "microbatches": MICROBATCHES, "timed_steps": args.steps,
                           "warmup_steps": WARMUP, "families": families},
              "matrix": matrix, "wall_s": wall, "torch_threads_per_rank": 1}
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {shown(out)} ({wall:.0f} s)")


if __name__ == "__main__":
    main()
