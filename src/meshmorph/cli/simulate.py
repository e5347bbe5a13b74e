"""``meshmorph simulate`` and ``meshmorph advise``: a training run on transient cloud GPUs."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from meshmorph.cli.args import positive_float, positive_int
from meshmorph.cli.output import write_json


def _price(cluster: Any, spot: bool, catalog: Any) -> float:
    group = cluster.groups[0]
    if group.price_per_gpu_hour is not None and group.transient == spot:
        return group.price_per_gpu_hour
    price = group.gpu.spot_price_per_hour if spot else group.gpu.price_per_hour
    if price is None:
        for instance in catalog.instances.values():
            if instance.gpu == group.gpu.name:
                price = instance.price_per_gpu_hour(spot)
                if price is not None:
                    break
    if price is None:
        kind = "spot" if spot else "on-demand"
        raise ValueError(f"no {kind} price for {group.gpu.name}; set price_per_gpu_hour in the "
                         "cluster file (transient = true for spot) or add an instance with "
                         "--catalog FILE")
    return price


def _simulate(args: argparse.Namespace) -> int:
    from meshmorph.plan.report import report_console
    from meshmorph.predict.cloud_catalog import load_catalog
    from meshmorph.predict.overheads import Overheads
    from meshmorph.predict.simulate import SimulationConfig, simulate_run, summarize
    from meshmorph.predict.training_job import TrainingJob, default_global_batch, steps_for_tokens
    from meshmorph.spec.catalog import load_model
    from meshmorph.spec.cluster import parse_cluster
    from meshmorph.viz.predict_charts import write_timeline_chart

    if args.gpus:
        from meshmorph.spec.gpus import load_gpus_toml

        load_gpus_toml(args.gpus)
    catalog = load_catalog(args.catalog)
    model = load_model(args.model)
    cluster = parse_cluster(args.cluster)
    provider = catalog.provider(args.provider or cluster.provider or "gcp-preemptible")
    gpu = cluster.groups[0].gpu
    batch = args.global_batch or default_global_batch(model.seq_len, cluster.world_size)
    steps = steps_for_tokens(args.tokens, batch, model.seq_len)
    strategies = [args.strategy] if args.strategy else ["restart", "reshape", "on-demand"]
    if not args.spot:
        strategies = ["on-demand"]
    console = report_console()
    results, examples = {}, {}
    for strategy in strategies:
        spot = strategy != "on-demand"
        job = TrainingJob(model=model, cluster=cluster, global_batch=batch, total_steps=steps,
                          price_per_gpu_hour=_price(cluster, spot, catalog))
        if job.plan(job.nodes) is None:
            raise ValueError(f"no plan of {model.name} fits {cluster.describe()}; use more or "
                             "larger GPUs (see meshmorph plan)")
        hazard = provider.hazard_for(gpu.name)
        overheads = Overheads(spot=spot, gpu=gpu.name, gpus_per_node=cluster.gpus_per_node,
                              inter_node_gbps=cluster.inter_link.bandwidth_gbps)
        runs = [simulate_run(job, hazard, overheads, SimulationConfig(strategy=strategy), seed)
                for seed in range(args.seed, args.seed + args.runs)]
        results[strategy] = {**summarize(runs), "price_per_gpu_hour": job.price_per_gpu_hour,
                             "step_time_s": job.step_time_s(job.nodes),
                             "plan": job.plan(job.nodes).to_dict()}
        examples[strategy] = runs[0]
    console.print(f"[bold]{model.name}[/], {args.tokens:.3g} tokens = {steps} steps of {batch} "
                  f"sequences on {cluster.describe()} ({cluster.world_size} GPUs); revocations: "
                  f"{provider.name} ({provider.notice_s:g} s notice"
                  + (f", {provider.max_runtime_h:g} h cap)" if provider.max_runtime_h else ")"))
    from rich.table import Table

    table = Table(title=f"{args.runs} simulated runs per strategy", title_justify="left")
    for name in ("strategy", "$/GPU-h", "time P50 h", "time P90 h", "cost P50 $", "cost P90 $",
                 "revocations", "lost steps"):
        table.add_column(name, justify="left" if name == "strategy" else "right")
    for strategy, r in results.items():
        table.add_row(strategy, f"{r['price_per_gpu_hour']:.3f}", f"{r['time_h_p50']:.2f}",
                      f"{r['time_h_p90']:.2f}", f"{r['cost_usd_p50']:,.0f}",
                      f"{r['cost_usd_p90']:,.0f}", f"{r['revocations_mean']:.1f}",
                      f"{r['lost_steps_mean']:.1f}")
    console.print(table)
    if args.json:
        write_json(args.json, {"model": model.name, "cluster": cluster.describe(),
                                "provider": provider.name, "tokens": args.tokens, "steps": steps,
                                "global_batch": batch, "strategies": results})
        console.print(f"results written to {args.json}")
    if args.png:
        write_timeline_chart(examples, args.png, f"{model.name} on {cluster.describe()}: run 1")
        console.print(f"timeline chart: {args.png}")
    return 0


def _advise(args: argparse.Namespace) -> int:
    from rich.table import Table

    from meshmorph.plan.report import report_console
    from meshmorph.predict.advise import AdviceOptions, advise, pareto, recommend
    from meshmorph.predict.cloud_catalog import load_catalog
    from meshmorph.spec.catalog import load_model

    if args.gpus:
        from meshmorph.spec.gpus import load_gpus_toml

        load_gpus_toml(args.gpus)
    model = load_model(args.model)
    options = AdviceOptions(runs=args.runs, deadline_h=args.deadline, budget_usd=args.budget)
    front = pareto(advise(model, args.tokens, load_catalog(args.catalog), options))
    console = report_console()
    if not front:
        raise ValueError("no option meets the deadline and budget; raise --deadline or --budget")
    pick = recommend(front, args.deadline)
    table = Table(title=f"{model.name}, {args.tokens:.3g} tokens: Pareto options (P50 over "
                        f"{args.runs} runs)", title_justify="left")
    for name in ("", "instance", "GPUs", "spot", "strategy", "tp/pp/dp", "time h (P90)",
                 "cost $ (P90)"):
        table.add_column(name, justify="left" if name in ("instance", "strategy") else "right")
    for o in front:
        plan = o["plan"]
        table.add_row("*" if o is pick else "", o["instance"], str(o["gpus"]),
                      "yes" if o["spot"] else "no", o["strategy"],
                      f"{plan['tp']}/{plan['pp']}/{plan['dp']}",
                      f"{o['time_h']:.1f} ({o['time_h_p90']:.1f})",
                      f"{o['cost_usd']:,.0f} ({o['cost_usd_p90']:,.0f})")
    console.print(table)
    console.print(f"recommended (*): {pick['gpus']} x {pick['gpu']} ({pick['instance']}, "
                  f"{'spot' if pick['spot'] else 'on-demand'}, {pick['strategy']}): "
                  f"{pick['time_h']:.1f} h, ${pick['cost_usd']:,.0f} (prices read {pick['price_date']})")
    if args.json:
        write_json(args.json, {"model": model.name, "tokens": args.tokens, "pareto": front,
                                "recommended": pick})
        console.print(f"options written to {args.json}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    sim = subparsers.add_parser(
        "simulate", help="simulate a training run with spot revocations: P50/P90 time and cost",
        description="Discrete-event simulation (simpy) of a whole training run: step time from "
                    "the planner, revocations from the fitted hazard, checkpoint, restart and "
                    "reshape costs from CM-DARE's measurements.")
    sim.add_argument("--model", required=True, help="catalog model (see meshmorph models)")
    sim.add_argument("--tokens", required=True, type=positive_float, help="tokens to train on")
    sim.add_argument("--cluster", required=True, help="GPU:NODESxPER_NODE or a cluster .toml")
    sim.add_argument("--spot", action="store_true", help="spot/preemptible nodes (revocations)")
    sim.add_argument("--strategy", choices=("restart", "reshape", "on-demand"), default=None,
                     help="recovery strategy (default: all three with --spot)")
    sim.add_argument("--runs", type=positive_int, default=20, help="simulated runs (default 20)")
    sim.add_argument("--seed", type=int, default=0, help="first random seed (default 0)")
    sim.add_argument("--global-batch", type=positive_int, default=None,
                     help="sequences per step (default: about 2 M tokens)")
    sim.add_argument("--provider", default=None,
                     help="cloud offering (gcp-preemptible, gcp-spot, aws-spot, azure-spot; "
                          "default: the cluster file's, else gcp-preemptible)")
    sim.add_argument("--catalog", type=Path, default=None, help="your cloud catalog TOML")
    sim.add_argument("--gpus", type=Path, default=None, help="your GPU TOML ([gpus.NAME])")
    sim.add_argument("--json", type=Path, default=None, help="write the results as JSON")
    sim.add_argument("--png", type=Path, default=None, help="write a timeline chart (PNG)")
    sim.set_defaults(func=_simulate)

    adv = subparsers.add_parser(
        "advise", help="what to rent: Pareto table of (GPU, count, spot, plan, time, cost)",
        description="Plan and simulate every 8-GPU instance type of the cloud catalog at 1-8 "
                    "nodes, spot and on-demand; print the Pareto front and recommend one.")
    adv.add_argument("--model", required=True, help="catalog model (see meshmorph models)")
    adv.add_argument("--tokens", required=True, type=positive_float, help="tokens to train on")
    adv.add_argument("--deadline", type=positive_float, default=None, help="hours (P90)")
    adv.add_argument("--budget", type=positive_float, default=None, help="USD (P90)")
    adv.add_argument("--runs", type=positive_int, default=5, help="simulated runs per option (default 5)")
    adv.add_argument("--catalog", type=Path, default=None, help="your cloud catalog TOML")
    adv.add_argument("--gpus", type=Path, default=None, help="your GPU TOML ([gpus.NAME])")
    adv.add_argument("--json", type=Path, default=None, help="write the options as JSON")
    adv.set_defaults(func=_advise)
