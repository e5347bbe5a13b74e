"""``meshmorph plan --layerwise`` / ``--uniform``: print and write the layerwise search's result."""

from __future__ import annotations

import argparse
import json

from meshmorph.cost.model import CostModel
from meshmorph.plan.layerwise_search import search_layerwise
from meshmorph.plan.report import layer_strategy_summary, print_plans, report_console
from meshmorph.plan.space import SearchOptions
from meshmorph.spec.cluster import Cluster
from meshmorph.spec.model import ModelSpec


def plan_layerwise(args: argparse.Namespace, model: ModelSpec, cluster: Cluster,
                   options: SearchOptions, cost: CostModel) -> int:
    """Search, print the best plan beside the best uniform one, write ``--json``."""
    result = search_layerwise(model, cluster, global_batch=args.global_batch, options=options,
                              cost=cost, uniform_only=args.uniform)
    console = report_console()
    console.print(f"[bold]{model.name}[/] (seq {model.seq_len}) on {cluster.describe()} "
                  f"({cluster.world_size} GPUs), global batch {args.global_batch}, "
                  f"{'one strategy per stage' if args.uniform else 'a strategy per layer'}")
    print_plans([result.plan], console, model=model, title="best plan")
    for line in layer_strategy_summary(result.plan):
        console.print(f"layer strategies, {line}")
    uniform = result.uniform_estimate.tokens_per_s if result.uniform_estimate else None
    best = result.estimate.tokens_per_s
    gain = f" ({best / uniform - 1:+.2%})" if uniform else ""
    console.print(f"best {best:,.0f} tokens/s; best with one strategy per stage "
                  f"{'none fits' if uniform is None else f'{uniform:,.0f} tokens/s'}{gain}")
    console.print(f"{result.configurations} configurations, {result.configurations_solved} "
                  f"solved, in {result.search_time_s:.2f} s; proven within "
                  f"{result.optimality_gap:.2%} of the optimum under the layerwise cost model")
    if args.json:
        try:
            args.json.write_text(json.dumps({
                "search_time_s": result.search_time_s,
                "cluster": cluster.describe(),
                "layerwise": not args.uniform,
                "configurations": result.configurations,
                "configurations_solved": result.configurations_solved,
                "lower_bound_s": result.lower_bound_s,
                "optimality_gap": result.optimality_gap,
                "uniform_best_tokens_per_s": uniform,
                "plans": [result.plan.to_dict()],
            }, indent=2))
        except OSError as exc:
            raise ValueError(f"cannot write --json {args.json}: {exc.strerror}") from None
        console.print(f"plans written to {args.json}")
    return 0
