"""``meshmorph advise``: what to rent, as the Pareto set of (time, cost) with the policy, zones and
plan of each point."""

from __future__ import annotations

import argparse

from meshmorph.cli.args import positive_float
from meshmorph.cli.output import finish, write_json
from meshmorph.cli.simulate import add_job_flags, first_few
from meshmorph.predict.advise import AdviceOptions, advise, pareto, recommend
from meshmorph.predict.cloud_catalog import load_catalog
from meshmorph.spec.catalog import load_model
from meshmorph.spec.gpus import load_gpus_toml
from meshmorph.tables import Column, print_table, report_console

ADVISE_COLUMNS = (Column(""), Column("instance", justify="left", wrap=20), Column("GPUs"),
                  Column("policy", justify="left"), Column("zones", justify="left", wrap=24),
                  Column("tp/pp/dp"), Column("time h (P90)", "time h"),
                  Column("cost $ (P90)", "cost $"))
"""Columns of ``meshmorph advise`` (``*`` marks the recommended option)."""


def _nothing(model: str, tokens: float, options: AdviceOptions) -> str:
    """Why no option is left, naming only the limits the user gave."""
    given = [f"--deadline {options.deadline_h:g} h" if options.deadline_h is not None else "",
             f"--budget ${options.budget_usd:,.0f}" if options.budget_usd is not None else ""]
    given = [g for g in given if g]
    if given:
        return (f"no option trains {tokens:.3g} tokens of {model} within {' and '.join(given)}; "
                f"raise {' or '.join(g.split()[0] for g in given)}, or train fewer tokens")
    nodes = max(options.node_counts)
    return (f"no catalog instance trains {tokens:.3g} tokens of {model} within "
            f"{options.max_days:g} days on up to {nodes} instances (or the model fits none of "
            f"them); train fewer tokens, or give a catalog with larger instances (--catalog)")


def _advise(args: argparse.Namespace) -> int:
    if args.gpus:
        load_gpus_toml(args.gpus)
    model = load_model(args.model)
    options = AdviceOptions(runs=args.runs, deadline_h=args.deadline, budget_usd=args.budget)
    front = pareto(advise(model, args.tokens, load_catalog(args.catalog), options))
    if not front:
        raise ValueError(_nothing(model.name, args.tokens, options))
    pick = recommend(front, args.deadline)
    assert pick is not None
    console = report_console(args.wide)
    rows = [["*" if o is pick else "", o["instance"], str(o["gpus"]), o["policy"],
             first_few(list(o["zones"]), 2),
             f"{o['plan']['tp']}/{o['plan']['pp']}/{o['plan']['dp']}",
             f"{o['time_h']:.1f} ({o['time_h_p90']:.1f})",
             f"{o['cost_usd']:,.0f} ({o['cost_usd_p90']:,.0f})"] for o in front]
    print_table(console, ADVISE_COLUMNS, rows,
                title=f"{model.name}, {args.tokens:.3g} tokens: Pareto options (P50 over "
                      f"{args.runs} runs, P90 in brackets)")
    console.print(f"recommended (*): {pick['gpus']} x {pick['gpu']} ({pick['instance']}, "
                  f"{pick['policy']}, {first_few(list(pick['zones']), 2)}): "
                  f"{pick['time_h']:.1f} h, ${pick['cost_usd']:,.0f} (prices read "
                  f"{pick['price_date']})")
    for note in sorted({n for o in front for n in o["notes"]}):
        console.print(f"[dim]note:[/] {note}")
    if args.json:
        write_json(args.json, {"model": model.name, "tokens": args.tokens,
                               "deadline_h": args.deadline, "pareto": front,
                               "recommended": pick})
        console.print(f"options written to {args.json}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    adv = subparsers.add_parser(
        "advise", help="what to rent: Pareto set of (time, cost) with policy, zones and plan",
        description="Plan and simulate every catalog instance type with 4 or more GPUs at 1-8 "
                    "instances under each policy (restart, multi-zone, deadline with --deadline, "
                    "on-demand) in the zones with data; print the Pareto front and recommend one. "
                    "Reshape: meshmorph simulate --policy reshape.")
    add_job_flags(adv, AdviceOptions, "hours (P90); adds the deadline policy")
    adv.add_argument("--budget", type=positive_float, default=None, help="USD (P90)")
    finish(adv, _advise, json="write the options as JSON")
