"""``meshmorph simulate``: a training run on spot GPUs across zones, P10/P50/P90 time and cost per
policy, from the fitted capacity and preemption processes or replayed from a recorded trace."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console

from meshmorph.cli.args import (
    MAX_RUNS,
    bounded_int,
    non_negative_int,
    positive_float,
    positive_int,
    token_count,
)
from meshmorph.cli.flags import add_field
from meshmorph.cli.output import finish, write_json
from meshmorph.predict.cloud_catalog import load_catalog
from meshmorph.predict.market import Market, MarketRequest, build_market
from meshmorph.predict.overheads import Overheads
from meshmorph.predict.policy import Policy
from meshmorph.predict.scenario import PolicyResult, Scenario, run_scenario
from meshmorph.predict.spot_data import PreemptionMode
from meshmorph.predict.traces import PACKAGED, load_trace
from meshmorph.predict.training_job import TrainingJob, default_global_batch, steps_for_tokens
from meshmorph.spec.catalog import load_model
from meshmorph.spec.cluster import Cluster, parse_cluster
from meshmorph.spec.gpus import load_gpus_toml
from meshmorph.tables import Column, print_table, report_console
from meshmorph.viz.predict_charts import write_timeline_chart

DEFAULT_PROVIDER = "gcp-spot"
"""Provider when neither --provider nor the cluster file names one."""

ZONE_COLUMNS = (Column("zone", justify="left"), Column("capacity share (95%)", "capacity (95%)"),
                Column("up h"), Column("wait h"), Column("spot $/node-h", "spot $/h"),
                Column("on-demand $/node-h", "on-demand $/h"))
"""Columns of the zones table of ``meshmorph simulate``."""


def zones_arg(text: str) -> tuple[str, ...]:
    """``auto`` (every zone with data) or a comma-separated list of zones."""
    if text.strip() == "auto":
        return ()
    zones = tuple(z.strip() for z in text.split(",") if z.strip())
    if not zones:
        raise argparse.ArgumentTypeError(f"expected auto or comma-separated zones such as "
                                         f"us-central1-a,us-east4-b, got {text!r}")
    return zones


def policies_for(args: argparse.Namespace, mode: PreemptionMode) -> tuple[Policy, ...]:
    """The policies to compare: the one asked, else all that apply (reshape only in lifetime
    mode: where a zone's capacity takes every node at once nobody survives to continue)."""
    if not args.spot:
        if args.policy not in (None, Policy.ON_DEMAND):
            raise ValueError(f"--policy {args.policy} handles preemptions of spot nodes, but "
                             "without --spot every node is on-demand; add --spot, or drop --policy")
        return (Policy.ON_DEMAND,)
    if args.policy:
        if args.policy is Policy.DEADLINE and args.deadline is None:
            raise ValueError("--policy deadline needs --deadline HOURS")
        return (args.policy,)
    every = (Policy.RESTART, Policy.RESHAPE, Policy.MULTI_ZONE, Policy.DEADLINE, Policy.ON_DEMAND)
    return tuple(p for p in every if (p is not Policy.DEADLINE or args.deadline is not None)
                 and (p is not Policy.RESHAPE or mode is PreemptionMode.LIFETIME))


def market_for(args: argparse.Namespace, cluster: Cluster) -> Market:
    """The zones, processes and prices the run may use."""
    group = cluster.groups[0]
    user_price = group.price_per_gpu_hour if group.transient else None
    return build_market(MarketRequest(
        gpu=group.gpu.name, gpus_per_node=cluster.gpus_per_node,
        provider=args.provider or cluster.provider or DEFAULT_PROVIDER, zones=args.zones,
        mode=args.preemption, trace=load_trace(args.trace) if args.trace else None,
        spot_gpu_usd_per_h=user_price), load_catalog(args.catalog))


def first_few(items: list[str], limit: int) -> str:
    """The first ``limit`` items, comma-separated, then ``+N`` for the N others."""
    return ", ".join(items[:limit]) + (f" +{len(items) - limit}" if len(items) > limit else "")


def _row(name: str, source: str | None, s: dict[str, Any], deadline: float | None) -> list[str]:
    cells = [name, *((source,) if source is not None else ()),
             first_few([f"{z} {share:.0%}" for z, share in s["zones"].items()], 3),
             " / ".join(f"{s[f'time_h_p{p}']:.1f}" for p in (10, 50, 90)),
             " / ".join(f"{s[f'cost_usd_p{p}']:,.0f}" for p in (10, 50, 90)),
             f"{s['preemptions_mean']:.1f}"]
    if deadline is not None:
        cells.append(f"{s['met_deadline']:.0%}")
    return cells


def print_results(console: Console, results: list[PolicyResult], runs: int,
                  deadline: float | None) -> None:
    """One row per policy (and per source with a trace): P10/P50/P90 time and cost, zones used."""
    traced = any(r.replay is not None for r in results)  # a "from" column only with a trace
    columns = [Column("policy", justify="left"), *((Column("from", justify="left"),) if traced
                                                   else ()),
               Column("zones used (share of training)", "zones used", "left", wrap=20),
               Column("time h"), Column("cost $"), Column("nodes lost", "lost")]
    if deadline is not None:
        columns.append(Column("met deadline", "met"))
    rows = []
    for r in results:
        rows.append(_row(str(r.policy), "fit" if traced else None, r.model, deadline))
        if r.replay is not None:
            rows.append(_row("", "trace", r.replay, deadline))
    print_table(console, columns, rows, title=f"{runs} runs per policy: P10 / P50 / P90")


def print_market(console: Console, market: Market, limit: int = 13) -> None:
    """The zones: capacity share (95% interval), mean periods, prices."""
    rows = []
    for zone in market.zones[:limit]:
        a = zone.availability
        share = "always (no data)" if a is None else \
            f"{a.share:.2f} ({a.share_ci95[0]:.2f}-{a.share_ci95[1]:.2f})"
        rows.append([zone.name, share, "-" if a is None else f"{a.up.mean_h:.1f}",
                     "-" if a is None else f"{a.down.mean_h:.2f}",
                     f"{zone.spot_node_usd_per_h:.2f}", f"{zone.on_demand_node_usd_per_h:.2f}"])
    print_table(console, ZONE_COLUMNS, rows,
                title=f"zones ({market.availability_source}; preemption: {market.mode}, "
                      f"lifetimes: {market.lifetime_source})")
    for note in market.notes:
        console.print(f"[dim]note:[/] {note}")


def _market_json(market: Market) -> dict[str, Any]:
    return {"provider": market.provider.name, "mode": str(market.mode),
            "availability_source": market.availability_source,
            "lifetime_source": market.lifetime_source, "notes": list(market.notes),
            "zones": [{"zone": z.name, "spot_node_usd_per_h": z.spot_node_usd_per_h,
                       "on_demand_node_usd_per_h": z.on_demand_node_usd_per_h,
                       "price": z.price_note,
                       "availability": None if z.availability is None else z.availability.to_dict(),
                       "lifetime": z.lifetime.source} for z in market.zones]}


def _simulate(args: argparse.Namespace) -> int:
    if args.gpus:
        load_gpus_toml(args.gpus)
    model, cluster = load_model(args.model), parse_cluster(args.cluster)
    batch = args.global_batch or default_global_batch(model.seq_len, cluster.world_size)
    steps = steps_for_tokens(args.tokens, batch, model.seq_len)
    job = TrainingJob(model=model, cluster=cluster, global_batch=batch, total_steps=steps)
    plan = job.plan(job.nodes) if cluster.homogeneous else None
    if plan is None:
        raise ValueError(f"no plan of {model.name} fits {cluster.describe()}; use more or larger "
                         "GPUs (see meshmorph plan)")
    market = market_for(args, cluster)
    results = run_scenario(Scenario(job=job, market=market, overheads=Overheads(),
                                    policies=policies_for(args, market.mode), runs=args.runs,
                                    seed=args.seed, deadline_h=args.deadline,
                                    replay=args.trace is not None))
    step_s = job.step_time_s(job.nodes)
    console = report_console(args.wide)
    console.print(f"[bold]{model.name}[/], {args.tokens:.3g} tokens = {steps} steps of {batch} "
                  f"sequences on {cluster.describe()} ({cluster.world_size} GPUs), plan tp "
                  f"{plan.tp} pp {plan.pp} dp {plan.dp}, step {step_s:.2f} s; "
                  f"{market.provider.name} ({market.provider.notice_s:g} s notice"
                  + (f", {market.provider.max_runtime_h:g} h cap)" if market.provider.max_runtime_h
                     else ")") + (f"; deadline {args.deadline:g} h" if args.deadline else ""))
    print_market(console, market)
    if args.spot and not args.policy and market.mode is PreemptionMode.CAPACITY:
        console.print("[dim]note:[/] reshape is left out: in capacity mode a zone's capacity "
                      "takes every node at once, so nobody survives to continue (it would be "
                      "restart); --preemption lifetime has survivors")
    print_results(console, results, args.runs, args.deadline)
    if args.json:
        write_json(args.json, {
            "model": model.name, "cluster": cluster.describe(), "tokens": args.tokens,
            "steps": steps, "global_batch": batch, "step_time_s": step_s,
            "plan": plan.to_dict(), "deadline_h": args.deadline, "market": _market_json(market),
            "policies": {str(r.policy): {"fit": r.model, "trace": r.replay, "zones": r.zones}
                         for r in results}})
        console.print(f"results written to {args.json}")
    if args.png:
        write_timeline_chart({str(r.policy): r.example for r in results if r.example}, args.png,
                             f"{model.name} on {cluster.describe()}: run 1")
        console.print(f"timeline chart: {args.png}")
    return 0


def add_job_flags(parser: argparse.ArgumentParser, options: type, deadline: str) -> None:
    """--model, --tokens, --deadline, --runs (``options.runs``' default and help), --catalog and
    --gpus: the flags ``simulate`` and ``advise`` share."""
    parser.add_argument("--model", required=True, help="catalog model (see meshmorph models)")
    parser.add_argument("--tokens", required=True, type=token_count, help="tokens to train on")
    parser.add_argument("--deadline", type=positive_float, default=None, metavar="HOURS",
                        help=deadline)
    add_field(parser, options, "runs", type=bounded_int(MAX_RUNS, "runs"))
    parser.add_argument("--catalog", type=Path, default=None,
                        help="your providers, zones and prices (TOML, examples/my_zones.toml)")
    parser.add_argument("--gpus", type=Path, default=None, help="your GPU TOML ([gpus.NAME])")


def register(subparsers: argparse._SubParsersAction) -> None:
    sim = subparsers.add_parser(
        "simulate", help="simulate a training run on spot GPUs: P10/P50/P90 time and cost",
        description="Discrete-event simulation (simpy) of a whole training run on spot nodes: "
                    "step time from the planner; per zone, capacity (the chance and the wait "
                    "to get nodes) and preemption fitted by maximum likelihood to packaged "
                    "measurements, or replayed from a trace; dated prices per region.")
    add_job_flags(sim, Scenario, "deadline from the first request: adds the deadline policy "
                                 "(spot while it allows, then on-demand) and the share of runs "
                                 "meeting it")
    sim.add_argument("--cluster", required=True, help="GPU:NODESxPER_NODE or a cluster .toml")
    sim.add_argument("--spot", action="store_true", help="spot nodes (else on-demand only)")
    sim.add_argument("--policy", "--strategy", type=Policy, choices=list(Policy), default=None,
                     help="what to do when capacity comes and goes (default: every policy)")
    sim.add_argument("--zones", type=zones_arg, default=(), metavar="auto|Z1,Z2",
                     help="zones to use (default auto: every zone with data for the GPU)")
    sim.add_argument("--trace", default=None, metavar="FILE|NAME",
                     help="replay a recorded trace beside the fit: a full.json (metadata."
                          "gap_seconds, data: 1 = no capacity), a folder of */full.json, or "
                          f"{', '.join(PACKAGED)}")
    sim.add_argument("--preemption", type=PreemptionMode, choices=list(PreemptionMode),
                     default=None, help="capacity: nodes go when the zone's capacity goes; "
                                        "lifetime: per-VM lifetimes (default: by the data)")
    add_field(sim, Scenario, "seed", type=non_negative_int, help="first random seed")
    sim.add_argument("--global-batch", type=positive_int, default=None,
                     help="sequences per step (default: about 2 M tokens)")
    sim.add_argument("--provider", default=None,
                     help=f"cloud offering (gcp-spot, gcp-preemptible, aws-spot, azure-spot; "
                          f"default: the cluster file's, else {DEFAULT_PROVIDER})")
    finish(sim, _simulate, json="write the results as JSON", png="write a timeline chart (PNG)")
