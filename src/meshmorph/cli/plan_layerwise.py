"""``meshmorph plan --layerwise`` / ``--uniform``: print and write the faster of the layerwise
search's best plan and the regular planner's (plan/layerwise_choice.py)."""

from __future__ import annotations

import argparse
import json

from meshmorph.cost.layerwise_cost import LAYERWISE_SCHEDULES, estimate_layerwise
from meshmorph.cost.model import CostModel
from meshmorph.plan.layerwise_choice import choose_layerwise
from meshmorph.plan.report import layer_strategy_summary, print_plans, report_console
from meshmorph.plan.space import SearchOptions
from meshmorph.spec.cluster import Cluster
from meshmorph.spec.model import ModelSpec


def _figure(tokens_per_s: float | None) -> str:
    return "none fits" if tokens_per_s is None else f"{tokens_per_s:,.0f} tokens/s"


def plan_layerwise(args: argparse.Namespace, model: ModelSpec, cluster: Cluster,
                   options: SearchOptions, cost: CostModel) -> int:
    """Search both ways, print the returned plan beside the best uniform and regular ones,
    write ``--json``."""
    runnable = getattr(args, "layerwise_schedules", "runnable") == "runnable"
    choice = choose_layerwise(model, cluster, global_batch=args.global_batch, options=options,
                              cost=cost, uniform_only=args.uniform, runnable=runnable)
    result = choice.layerwise
    console = report_console()
    console.print(f"[bold]{model.name}[/] (seq {model.seq_len}) on {cluster.describe()} "
                  f"({cluster.world_size} GPUs), global batch {args.global_batch}, "
                  f"{'one strategy per stage' if args.uniform else 'a strategy per layer'}, "
                  f"{'runnable schedules' if runnable else 'every schedule (priced only)'}")
    print_plans([choice.plan], console, model=model,
                title=f"best plan (from the {choice.source} search)")
    for line in layer_strategy_summary(choice.plan):
        console.print(f"layer strategies, {line}")
    best = choice.estimate.tokens_per_s
    layerwise = result.estimate.tokens_per_s if result else None
    uniform, regular = choice.uniform_tokens_per_s, choice.regular_tokens_per_s
    regular_lw = None  # the regular plan under the layerwise cost model, where it prices it
    if choice.regular is not None and choice.regular.plans[0].schedule in LAYERWISE_SCHEDULES:
        regular_lw = estimate_layerwise(cost, choice.regular.plans[0]).tokens_per_s
    console.print(f"returned the {choice.source} plan, {best:,.0f} tokens/s; layerwise search "
                  f"{_figure(layerwise)}, its best with one strategy per stage "
                  f"{_figure(uniform)}; regular planner {_figure(regular)}")
    if choice.layerwise_error:
        console.print(f"layerwise search: {choice.layerwise_error}")
    if not choice.runnable:
        console.print("[yellow]this plan cannot be run yet[/]: the layerwise runtime runs "
                      "pipelines without sequence parallelism, untied for pp > 1; plan with "
                      "--layerwise-schedules runnable for one it runs")
    if result is not None:
        console.print(f"layerwise: {result.configurations} configurations, "
                      f"{result.configurations_solved} solved, in {result.search_time_s:.2f} s; "
                      f"proven within {result.optimality_gap:.2%} of the optimum under the "
                      "layerwise cost model")
    if args.json:
        try:
            args.json.write_text(json.dumps({
                "search_time_s": result.search_time_s if result else None,
                "regular_search_time_s": choice.regular.search_time_s if choice.regular else None,
                "cluster": cluster.describe(),
                "layerwise": not args.uniform,
                "layerwise_schedules": "runnable" if runnable else "all",
                "returned": choice.source,
                "runnable": choice.runnable,
                "configurations": result.configurations if result else None,
                "configurations_solved": result.configurations_solved if result else None,
                "lower_bound_s": result.lower_bound_s if result else None,
                "optimality_gap": result.optimality_gap if result else None,
                "layerwise_best_tokens_per_s": layerwise,
                "uniform_best_tokens_per_s": uniform,
                "regular_best_tokens_per_s": regular,
                "regular_best_layerwise_cost_tokens_per_s": regular_lw,
                "plans": [choice.plan.to_dict()],
            }, indent=2))
        except OSError as exc:
            raise ValueError(f"cannot write --json {args.json}: {exc.strerror}") from None
        console.print(f"plans written to {args.json}")
    return 0



