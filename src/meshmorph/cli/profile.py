"""``meshmorph profile``: measure the local devices (GEMMs, collectives, layer and optimizer
times) and write a Profile the cost model reads."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from meshmorph.cli.args import positive_int
from meshmorph.cli.flags import add_field, add_fields, field_default
from meshmorph.cli.output import add_output
from meshmorph.profile.job import ProfileConfig, check_fits_memory


def _profile(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from meshmorph.profile.job import quick_config, run_profile

    models = tuple(args.models or field_default(ProfileConfig, "models"))
    config = quick_config(args.nproc, models, args.seq_len) if args.quick else \
        ProfileConfig(nproc=args.nproc, models=models, seq_len=args.seq_len)
    config = replace(config, nice=args.nice)
    check_fits_memory(config)  # before the progress bar: a refusal is one line
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


def register(subparsers: argparse._SubParsersAction) -> None:
    prof = subparsers.add_parser(
        "profile", help="measure the local devices: GEMMs, collectives, layer and optimizer times")
    add_output(prof, "--out", default=Path("profile.json"), help="Profile JSON to write (default profile.json)")
    add_fields(prof, ProfileConfig, "nproc", "nice")
    add_field(prof, ProfileConfig, "models", "--model", action="append", default=None, type=str,
              help="catalog model whose layers are timed (repeatable; default "
                   f"{' '.join(field_default(ProfileConfig, 'models'))})")
    add_field(prof, ProfileConfig, "seq_len", default=64, type=positive_int,
              help="sequence length of the layer timings")
    prof.add_argument("--quick", action="store_true", help="fewer repeats and sizes (well under a minute)")
    prof.set_defaults(func=_profile)
