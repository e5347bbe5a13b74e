"""``meshmorph profile`` (measure the local devices) and ``meshmorph validate`` (predicted
against measured step times of several plans)."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from meshmorph.cli.args import positive_int


def _profile(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from meshmorph.profile.job import ProfileConfig, quick_config, run_profile

    models = tuple(args.model)
    config = quick_config(args.nproc, models, args.seq_len) if args.quick else \
        ProfileConfig(nproc=args.nproc, models=models, seq_len=args.seq_len)
    config = replace(config, nice=args.nice)
    console = Console(stderr=True)
    with Progress(TextColumn("profiling"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("profile", total=config.steps())
        profile = run_profile(config, on_progress=lambda done: bar.update(task, completed=done))
    profile.save(args.out)
    out = Console()
    best = max(profile.gemm_flops_per_s.items(), key=lambda kv: kv[1])
    out.print(f"GEMM: best {best[1] / 1e9:.1f} GFLOP/s ({best[0]}) per process, "
              f"{config.nproc} processes at once")
    for key, row in sorted(profile.collectives.items()):
        out.print(f"{key:<18} alpha {row['alpha_s'] * 1e6:8.1f} us  "
                  f"{1 / row['beta_s_per_byte'] / 1e9:6.2f} GB/s  r2 {row['r2']:.3f}")
    out.print(f"layers: {len(profile.layer_times)} timings; optimizer tail "
              f"{profile.optimizer_fixed_s * 1e3:.2f} ms + {profile.optimizer_s_per_param * 1e9:.2f} "
              f"ns/param; load average {profile.load_avg:.2f} on {profile.cores} cores")
    out.print(f"wrote {args.out}")
    return 0


def _validate(args: argparse.Namespace) -> int:
    from meshmorph.profile.validate import ValidateConfig, report, run_validate

    config = ValidateConfig(num_plans=args.plans, nproc=args.nproc, model=args.model,
                            seq_len=args.seq_len, repeats=args.repeats, warmup=args.warmup,
                            profile_path=args.profile, tensor_parallel=args.tp, nice=args.nice,
                            interleave=not args.profile_once, quick_profile=args.quick)
    result = run_validate(config)
    report(result, json_path=args.json, png_path=args.png)
    return 0


NICE_HELP = ("priority increment of the measuring processes (default 0; negative, where "
             "privileged, runs them ahead of other work on the machine; the load is recorded)")


def register(subparsers: argparse._SubParsersAction) -> None:
    prof = subparsers.add_parser(
        "profile", help="measure the local devices: GEMMs, collectives, layer and optimizer times")
    prof.add_argument("--out", type=Path, default=Path("profile.json"),
                      help="Profile JSON to write (default profile.json)")
    prof.add_argument("--nproc", type=positive_int, default=2,
                      help="processes measuring at once (default 2); use the count you will train with")
    prof.add_argument("--model", action="append", default=None,
                      help="catalog model whose layers are timed (repeatable; default gpt-small)")
    prof.add_argument("--seq-len", type=positive_int, default=64,
                      help="sequence length of the layer timings (default 64)")
    prof.add_argument("--nice", type=int, default=0, help=NICE_HELP)
    prof.add_argument("--quick", action="store_true", help="fewer repeats and sizes (well under a minute)")
    prof.set_defaults(func=lambda a: _profile(_defaults(a)))

    val = subparsers.add_parser(
        "validate", help="run several plans on local processes; predicted vs measured step time")
    val.add_argument("--plans", type=positive_int, default=8, help="plans to run (default 8)")
    val.add_argument("--nproc", type=positive_int, default=2, help="processes (default 2)")
    val.add_argument("--model", default="gpt-small", help="catalog model (default gpt-small)")
    val.add_argument("--seq-len", type=positive_int, default=64, help="sequence length (default 64)")
    val.add_argument("--repeats", type=positive_int, default=5,
                     help="timed steps per plan after warm-up (default 5)")
    val.add_argument("--warmup", type=positive_int, default=2,
                     help="untimed steps per plan before the timed ones (default 2)")
    val.add_argument("--profile", type=Path, default=None,
                     help="use this Profile instead of profiling just before (default: profile first)")
    val.add_argument("--tp", action="store_true",
                     help="also run tensor-parallel plans (not profiled on CPU: marked outside)")
    val.add_argument("--nice", type=int, default=0, help=NICE_HELP)
    val.add_argument("--profile-once", action="store_true",
                     help="predict every plan from the profile taken before them all (default: "
                          "from profile pieces measured between each plan's own steps)")
    val.add_argument("--quick", action="store_true",
                     help="take the profile that chooses the plans with the quick settings")
    val.add_argument("--json", type=Path, default=None, help="write the table as JSON")
    val.add_argument("--png", type=Path, default=None, help="write the predicted-vs-measured chart")
    val.set_defaults(func=_validate)


def _defaults(args: argparse.Namespace) -> argparse.Namespace:
    if args.model is None:
        args.model = ["gpt-small"]
    return args
