"""Layerwise planning on Galvatron's published settings: predicted throughput and search time.

    python bench/plan_layerwise.py [--quick]

llama2-7b, seq 2048, bf16, on 8 x A100 40 GB and 80 GB (global batch 16-64), the same A100s
capped at 16 GB (Galvatron's memory-constrained cases), and 16-64 x A100 80 GB. For each case:
what ``plan --layerwise`` returns (the faster of the runnable per-layer search's best and the
regular planner's, ``plan.search.search`` with ``SearchOptions.layerwise``), the wide search's
best (every schedule, priced only: ``--layerwise-schedules all``), the runnable search's best
plan with a strategy per layer, the best with one strategy per stage it met (both priced layer
by layer, cost/segments.py), meshmorph's regular planner (every layer of a chunk one segment)
and the regular planner's plan priced layer by layer (``as_layerwise``: the same plan under the
model the per-layer search minimises: the layerwise best is never slower than it, up to the
reported optimality gap), the proven optimality gap, and the per-layer
search's wall-clock and CPU seconds (the median of ``--repeats`` runs, 3 by default, each
from a fresh cost model) beside Galvatron's measured search times on its own
llama2-7b profiles (40 s on 4 GPUs, 105-300 s on 8-16 GPUs, 25 min with the batch size searched
too).
Writes bench/results/latest/plan_layerwise.json (``--out PATH`` to choose, ``--update`` for the
committed bench/results/plan_layerwise.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import replace

from meshmorph.cost.model import CostModel
from meshmorph.cost.segments import as_layerwise
from meshmorph.plan.report import layer_strategy_summary, recompute_summary
from meshmorph.plan.search import search, search_per_layer
from meshmorph.plan.space import SearchOptions
from meshmorph.schedule.table import Schedule
from meshmorph.spec import catalog_model, parse_cluster
from meshmorph.spec.cluster import Cluster
from meshmorph.spec.plan import PlanError
from results_path import Outputs, wrote

OUTPUTS = Outputs("bench/results/plan_layerwise.json")

GALVATRON_SEARCH_S = {4: 40.0, 8: 105.0, 16: 300.0}
"""Galvatron's measured search times on its llama2-7b profiles (8-16 GPUs: 105-300 s)."""

CASES = [  # (cluster, memory cap GiB or None, global batch)
    ("a100-40g:1x8", None, 16), ("a100-40g:1x8", None, 32), ("a100-40g:1x8", None, 64),
    ("a100-80g:1x8", None, 16), ("a100-80g:1x8", None, 32), ("a100-80g:1x8", None, 64),
    ("a100-40g:1x8", 16, 16), ("a100-40g:1x8", 16, 32), ("a100-40g:1x8", 16, 64),
    ("a100-40g:1x8", 24, 32),
    ("a100-80g:2x8", None, 64), ("a100-80g:4x8", None, 64), ("a100-80g:8x8", None, 64),
]


def capped(cluster: Cluster, memory_gib: float | None) -> Cluster:
    """The cluster with every GPU's memory set to ``memory_gib`` (same speed)."""
    if memory_gib is None:
        return cluster
    return replace(cluster, groups=tuple(
        replace(g, gpu=replace(g.gpu, memory_gib=memory_gib)) for g in cluster.groups))


def run_case(shorthand: str, cap: float | None, batch: int, regular: bool,
             repeats: int = 3) -> dict:
    model = catalog_model("llama2-7b").with_seq_len(2048)
    cluster = capped(parse_cluster(shorthand), cap)
    options = SearchOptions(top_k=1)
    row: dict = {"cluster": shorthand, "memory_gib": cap or cluster.groups[0].gpu.memory_gib,
                 "gpus": cluster.world_size, "global_batch": batch}
    walls, cpus = [], []
    for _ in range(repeats):  # each from a fresh cost model: nothing cached between them
        cost = CostModel(model, cluster)
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            result = search_per_layer(model, cluster, global_batch=batch, options=options,
                                      cost=cost)
        except PlanError as exc:
            row["layerwise"] = f"does not fit: {exc}"
            return row
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    row["search_wall_s"] = statistics.median(walls)
    row["search_cpu_s"] = statistics.median(cpus)
    row["search_cpu_s_runs"] = cpus
    row["search_wall_s_runs"] = walls
    row["runnable"] = result.runnable
    wide = search_per_layer(model, cluster, global_batch=batch, cost=cost,
                            options=replace(options, runnable_only=False))
    row["wide_tokens_per_s"] = wide.estimates[0].tokens_per_s
    row["wide_runnable"] = wide.runnable
    w = wide.plans[0]
    row["wide_plan"] = f"pp{w.pp} {w.schedule} v{w.vpp} sp{int(w.sequence_parallel)}"
    row["configurations"] = result.configurations
    row["configurations_solved"] = result.configurations_solved
    row["optimality_gap"] = result.optimality_gap
    row["layerwise_tokens_per_s"] = result.estimates[0].tokens_per_s
    row["uniform_best_tokens_per_s"] = (result.uniform_estimate.tokens_per_s
                                        if result.uniform_estimate else None)
    plan = result.plans[0]
    row["layerwise_plan"] = (f"pp{plan.pp} {plan.schedule} v{plan.vpp} "
                             f"sp{int(plan.sequence_parallel)} "
                             f"mb{plan.micro_batch}x{plan.num_microbatches} "
                             + (f"all tp{plan.tp} dp{plan.dp} z{plan.zero}" if len(
                                 {s for st in plan.stages for s in st.layer_strategies or ()}) <= 1
                                else "; ".join(layer_strategy_summary(plan))))
    row["galvatron_search_s"] = GALVATRON_SEARCH_S.get(cluster.world_size)
    if regular:
        try:
            best = search(model, cluster, global_batch=batch, options=options, cost=cost)
            row["regular_planner_tokens_per_s"] = best.estimates[0].tokens_per_s
            faster = best.estimates[0].tokens_per_s >= result.estimates[0].tokens_per_s
            row["returned"] = "regular" if faster else "layerwise"  # plan --layerwise's rule
            row["returned_tokens_per_s"] = max(best.estimates[0].tokens_per_s,
                                               result.estimates[0].tokens_per_s)
            p = best.plans[0]
            if p.schedule != Schedule.ASYNC and p.cp == 1:
                row["regular_plan_layerwise_tokens_per_s"] = cost.estimate(
                    as_layerwise(p)).tokens_per_s
            row["regular_plan"] = (f"tp{p.tp} pp{p.pp} dp{p.dp} z{p.zero} sp{int(p.sequence_parallel)}"
                                   f" {p.schedule} v{p.vpp} mb{p.micro_batch}x{p.num_microbatches}"
                                   f" recompute {recompute_summary(p, model)}")
        except PlanError as exc:
            row["regular_planner_tokens_per_s"] = None
            row["regular_planner"] = str(exc).split(";")[0]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the first four cases only")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of the runnable search per case; its times are their median")
    parser.add_argument("--no-regular", action="store_true",
                        help="skip the regular planner's figure (its own cost model)")
    OUTPUTS.add_args(parser)
    args = parser.parse_args()
    out = OUTPUTS.path(args)
    rows = [run_case(*case, regular=not args.no_regular, repeats=args.repeats)
            for case in (CASES[:4] if args.quick else CASES)]
    print(f"{'cluster':<14}{'GiB':>5}{'B':>4}  {'returned':>10} {'from':>9} {'wide':>10} "
          f"{'layerwise':>10} {'uniform':>10} {'gain':>7} "
          f"{'regular':>10} {'reg@lw':>10} {'gap':>6}  {'search s':>8} {'cpu s':>6} "
          f"{'Galvatron s':>11}  plan")
    for r in rows:
        if "layerwise_tokens_per_s" not in r:
            print(f"{r['cluster']:<14}{r['memory_gib']:>5g}{r['global_batch']:>4}  {r['layerwise']}")
            continue
        lw, un = r["layerwise_tokens_per_s"], r["uniform_best_tokens_per_s"]
        gain = f"{lw / un - 1:+.2%}" if un else "n/a"
        reg = r.get("regular_planner_tokens_per_s")
        galv = r["galvatron_search_s"]
        print(f"{r['cluster']:<14}{r['memory_gib']:>5g}{r['global_batch']:>4}  "
              f"{r.get('returned_tokens_per_s') or 0:>10,.0f} {r.get('returned', '-'):>9} "
              f"{r['wide_tokens_per_s']:>10,.0f} {lw:>10,.0f} "
              f"{un or 0:>10,.0f} {gain:>7} {reg or 0:>10,.0f} "
              f"{r.get('regular_plan_layerwise_tokens_per_s') or 0:>10,.0f} "
              f"{r['optimality_gap']:>6.2%}  {r['search_wall_s']:>8.2f} "
              f"{r['search_cpu_s']:>6.2f} {galv if galv else '-':>11}  {r['layerwise_plan']}")
    out.write_text(json.dumps({"python": platform.python_version(), "machine": platform.machine(),
                               "model": "llama2-7b", "seq_len": 2048, "cases": rows},
                              indent=2) + "\n")
    for r in rows:
        print(f"wide search (priced only), {r['cluster']} {r['memory_gib']:g} GiB "
              f"B={r['global_batch']}: {r.get('wide_plan')}, runs: {r.get('wide_runnable')}")
    for r in rows:
        if r.get("regular_plan"):
            print(f"regular planner, {r['cluster']} {r['memory_gib']:g} GiB B={r['global_batch']}: "
                  f"{r['regular_plan']}")
    wrote(out)


if __name__ == "__main__":
    main()
