"""The one console script: ``meshmorph <subcommand>``. Each subcommand module registers itself
through ``register(subparsers)`` (a module that fails to import is an error, never a missing
command); errors a user can act on become a one-line message and exit code 2."""

from __future__ import annotations

import argparse
import importlib
import sys

from meshmorph.cli.output import check_outputs

_COMMAND_MODULES = ("plan", "catalogs", "run", "demo", "reshape", "timeline", "streams", "simulate",
                    "advise", "profile", "validate")
"""The modules of meshmorph.cli that register subcommands, in the order of ``meshmorph --help``
(plan: plan and estimate; catalogs: models and gpus; the others one each)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshmorph",
        description="Plan, run and reshape hybrid-parallel training of PyTorch models.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in _COMMAND_MODULES:
        importlib.import_module(f"meshmorph.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:  # Ctrl-C while the subcommands import (torch, in the first second) says so in one line
        args = build_parser().parse_args(argv)
        check_outputs(args)
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("meshmorph: interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError) as exc:
        # PlanError, PlanDoesNotFit and config errors are ValueErrors with actionable messages
        print(f"meshmorph: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
