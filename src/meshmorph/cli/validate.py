"""``meshmorph validate``: run several plans on local processes and compare their measured step
times and state bytes with the cost model's predictions."""

from __future__ import annotations

import argparse

from meshmorph.cli.flags import add_field, add_fields, config_from
from meshmorph.cli.output import add_output
from meshmorph.profile.validate import ValidateConfig


def _validate(args: argparse.Namespace) -> int:
    from meshmorph.profile.validate import report, run_validate

    result = run_validate(config_from(args, ValidateConfig))
    report(result, json_path=args.json, png_path=args.png)
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
    add_output(val, "--json", help="write the table as JSON")
    add_output(val, "--png", help="write the predicted-vs-measured chart")
    val.set_defaults(func=_validate)
