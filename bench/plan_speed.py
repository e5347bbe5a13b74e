"""Planner search time on the issue's large cases, beside brute-force enumeration where it finishes.

    python bench/plan_speed.py [--quick] [--repeat N] [--out PATH]

For each case it prints the search time in CPU seconds (median of --repeat searches, each in a
fresh interpreter as ``meshmorph plan`` runs, beside their median wall time: on a machine
shared with other jobs wall time measures them), the configurations in the space and how many
were solved, the best plan, its predicted step time and the proven optimality gap. Brute force
scores every plan of the same space with the cost model; it runs only when the space has at most
--brute-limit plans (the count is printed either way): on the large cases it cannot, so a last,
small instance (gpt-tiny on 4 CPU processes, restricted options, exact search) compares the two
side by side.
Prints the figures; writes them as JSON only to --out (the committed figures are
bench/results/plan_speed.json).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from meshmorph.cost.model import CostModel
from meshmorph.plan.brute_force import brute_force, count_plans
from meshmorph.plan.search import search
from meshmorph.plan.space import SearchOptions, configurations
from meshmorph.spec import catalog_model, parse_cluster

CASES = [  # (model, sequence length (None: its own), cluster, global batch, options)
    ("gpt3-175b", None, "a100-80g:128x8", 1536, None),
    ("llama3-70b", None, "h100:8x8", 512, None),
    ("llama3-405b", None, "h100:2048x8", 2048, None),
    ("llama2-13b", None, "h100:4x8+a100-80g:4x8", 256, None),
    ("qwen2.5-32b", 4096, "h100:48x8", 192, None),
    # small enough for brute force: the side-by-side comparison, exact search
    ("gpt-tiny", None, "cpu:1x4", 8, SearchOptions(max_micro_batch=2, zero_stages=(0, 3),
                                                   tolerance=0.0, max_nodes=None, top_k=1,
                                                   dtype="fp32")),
]


def _timed_search(name: str, seq_len: int | None, cluster_text: str, batch: int,
                  options: SearchOptions) -> tuple[float, float]:
    """Wall and CPU seconds of one search, in the process this runs in."""
    model, cluster = catalog_model(name, seq_len), parse_cluster(cluster_text)
    started, cpu_started = time.perf_counter(), time.process_time()
    search(model, cluster, global_batch=batch, options=options)
    return time.perf_counter() - started, time.process_time() - cpu_started


def run_case(name: str, seq_len: int | None, cluster_text: str, batch: int,
             options: SearchOptions | None, brute_limit: int, repeat: int = 1) -> dict:
    model = catalog_model(name, seq_len)
    cluster = parse_cluster(cluster_text)
    options = options or SearchOptions()
    walls, cpus = [], []
    # each search in a fresh interpreter, as `meshmorph plan` runs: no schedule program or layer
    # cost cached by an earlier search
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                             max_tasks_per_child=1) as pool:
        for _ in range(repeat):
            wall, cpu = pool.submit(_timed_search, name, seq_len, cluster_text, batch,
                                    options).result()
            walls.append(wall)
            cpus.append(cpu)
    result = search(model, cluster, global_batch=batch, options=options)
    search_s = statistics.median(cpus)
    best, estimate = result.plans[0], result.estimates[0]
    configs = list(configurations(model, cluster, batch, options))
    plans_in_space = count_plans(model, configs, options)
    row = {
        "model": name, "seq_len": model.seq_len, "cluster": cluster_text, "global_batch": batch,
        "search_time_s": search_s, "search_times_s": cpus,
        "search_wall_s": statistics.median(walls), "configurations": result.configurations,
        "configurations_solved": result.configurations_solved,
        "optimality_gap": result.optimality_gap, "plans_in_space": plans_in_space,
        "best": {"tp": best.tp, "pp": best.pp, "dp": best.dp, "zero": best.zero,
                 "micro_batch": best.micro_batch, "num_microbatches": best.num_microbatches,
                 "schedule": str(best.schedule), "vpp": best.vpp,
                 "sequence_parallel": best.sequence_parallel},
        "step_time_s": estimate.step_time_s, "mfu": estimate.mfu,
        "brute_force_time_s": None, "brute_force_step_time_s": None,
    }
    if plans_in_space <= brute_limit:
        started = time.process_time()
        _, bf_estimate = brute_force(model, cluster, global_batch=batch, options=options,
                                     cost=CostModel(model, cluster), max_plans=brute_limit)
        row["brute_force_time_s"] = time.process_time() - started
        row["brute_force_step_time_s"] = bf_estimate.step_time_s
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip the 16,384-GPU case")
    parser.add_argument("--brute-limit", type=int, default=300_000,
                        help="run brute force only when the space has at most this many plans")
    parser.add_argument("--repeat", type=int, default=3,
                        help="searches per case; the median CPU time is reported, beside the "
                             "median wall time (a loaded machine's noise)")
    parser.add_argument("--out", type=Path, default=None,
                        help="also write the figures as JSON here (bench/results/plan_speed.json "
                             "holds the committed ones); default: print only")
    args = parser.parse_args()
    rows = []
    for name, seq_len, cluster, batch, options in CASES:
        if args.quick and cluster.startswith("h100:2048"):
            continue
        row = run_case(name, seq_len, cluster, batch, options, args.brute_limit, args.repeat)
        rows.append(row)
        b = row["best"]
        brute = (f"brute force {row['brute_force_time_s']:.1f} s "
                 f"(step {row['brute_force_step_time_s']:.4f} s, "
                 f"{row['brute_force_time_s'] / row['search_time_s']:.0f}x the search)"
                 if row["brute_force_time_s"] is not None else
                 f"brute force not run ({row['plans_in_space']:.3g} plans)")
        print(f"{name:12s} {cluster:24s} B={batch:<5d} s={row['seq_len']:<5d} "
              f"search {row['search_time_s']:5.2f} s CPU (wall {row['search_wall_s']:.2f} s)  "
              f"{row['configurations_solved']}/{row['configurations']} configs  "
              f"gap {row['optimality_gap']:.2%}  best tp{b['tp']} pp{b['pp']} dp{b['dp']} "
              f"z{b['zero']} mb{b['micro_batch']}x{b['num_microbatches']} {b['schedule']}"
              f"{'' if b['vpp'] == 1 else b['vpp']} step {row['step_time_s']:.3f} s "
              f"MFU {row['mfu']:.1%} | {brute}", flush=True)
    if args.out is None:
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": platform.platform(), "python": platform.python_version(),
        "time": "CPU seconds (time.process_time), median of repeat", "repeat": args.repeat,
        "cases": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
