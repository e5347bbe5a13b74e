"""``meshmorph validate``: run several plans on local processes and compare their measured step
times and state bytes with the cost model's predictions."""

from __future__ import annotations

import argparse
from pathlib import Path

from meshmorph.cli.flags import add_field, add_fields, config_from
from meshmorph.cli.output import finish, write_json
from meshmorph.profile.validate import ValidateConfig
from meshmorph.tables import Column, print_table, report_console
from meshmorph.viz.validate_chart import chart

VALIDATE_COLUMNS = (Column("plan", justify="left", wrap=30), Column("measured s", "meas s"),
                    Column("predicted s", "pred s"), Column("range s", "range s", drop=1),
                    Column("error"), Column("state MiB meas/pred", "state MiB m/p", wrap=13),
                    Column("note", justify="left", wrap=20))
"""Columns of ``meshmorph validate``: the plan's name wraps rather than being cut."""


def report(result: dict[str, object], *, json_path: Path | None, png_path: Path | None,
           wide: bool = False) -> None:
    """Print the prediction-vs-measurement table; write the JSON and the chart if asked."""
    rows: list[dict[str, object]] = result["plans"]  # type: ignore[assignment]
    cells = []
    for r in rows:
        meas, pred = float(r["measured_step_s"]), float(r["predicted_step_s"])  # type: ignore[arg-type]
        cells.append([str(r["name"]), f"{meas:.4f}", f"{pred:.4f}",
                      f"{float(r['predicted_low_s']):.4f}-{float(r['predicted_high_s']):.4f}",  # type: ignore[arg-type]
                      f"{100 * (pred - meas) / meas:+.1f}%",
                      f"{float(r['state_bytes_rank0']) / 2**20:.1f}/"  # type: ignore[arg-type]
                      f"{float(r['predicted_state_bytes_rank0']) / 2**20:.1f}",  # type: ignore[arg-type]
                      "; ".join(r["outside_profile"]) or ""])  # type: ignore[arg-type]
    console = report_console(wide)
    print_table(console, VALIDATE_COLUMNS, cells,
                title=f"{result['model']} seq {result['seq_len']} on {result['nproc']} processes")
    if result.get("too_busy"):
        console.print(f"[bold]{result['too_busy']}[/]")
    else:
        _figures(console, result, len(rows))
    if json_path is not None:
        write_json(json_path, result)
        console.print(f"wrote {json_path}")
    if png_path is not None:
        title = ("validate: the machine was too busy to measure" if result.get("too_busy") else
                 f"validate: MAPE {float(result['mape']):.1f}%, "  # type: ignore[arg-type]
                 f"tau {float(result['kendall_tau']):.2f}")  # type: ignore[arg-type]
        chart(rows, png_path, title)
        console.print(f"wrote {png_path}")


def _figures(console, result: dict[str, object], plans: int) -> None:  # type: ignore[no-untyped-def]
    """The MAPE and Kendall tau lines of a measurement taken on a quiet enough machine."""
    console.print(f"MAPE {float(result['mape']):.1f}%  Kendall tau {float(result['kendall_tau']):.3f}  "  # type: ignore[arg-type]
                  f"measured inside the predicted range: {result['in_range']}/{plans}  "
                  f"load average at profile {float(result['load_avg_profile']):.2f} "  # type: ignore[arg-type]
                  f"on {result['cores']} cores")
    if "mape_profile_before" in result:
        low, high = result.get("load_avg_plans", (0.0, 0.0))  # type: ignore[misc]
        console.print(f"predicted from: {result.get('method', 'interleaved')}; from the profile "
                      f"taken before the plans alone: MAPE {float(result['mape_profile_before']):.1f}%  "  # type: ignore[arg-type]
                      f"Kendall tau {float(result['kendall_tau_profile_before']):.3f}; load average "  # type: ignore[arg-type]
                      f"{low:.2f}-{high:.2f} while the plans ran")


def _validate(args: argparse.Namespace) -> int:
    from meshmorph.profile.validate import run_validate

    result = run_validate(config_from(args, ValidateConfig))
    report(result, json_path=args.json, png_path=args.png, wide=args.wide)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    val = subparsers.add_parser(
        "validate", help="run several plans on local processes; predicted vs measured step time")
    add_fields(val, ValidateConfig, "nproc", "model", "seq_len", "repeats", "warmup", "nice",
               num_plans="--plans", profile_path="--profile", tensor_parallel="--tp",
               quick_profile="--quick")
    add_field(val, ValidateConfig, "interleave", "--profile-once",
              help="predict every plan from the profile taken before them all (default: from "
                   "profile pieces measured between each plan's own steps)")
    finish(val, _validate, json="write the table as JSON", png="write the predicted-vs-measured chart")
