"""Accuracy of the cost model on this machine: ``meshmorph validate`` three times in a row.

Each run takes a quick profile (it only chooses the plans: every candidate plan is predicted
from it and the 8 whose predictions lie furthest apart run; ``--full-profile`` for the full
one), then runs the 8 plans of gpt-small seq 64 on 2 gloo processes in one spawned job. Each
plan is predicted from profile pieces sampled between its own steps (profile/interleaved.py:
layer passes as long as one rank's compute, optimizer tails, every collective, FSDP2's units
for ZeRO-2/3 plans), one profile per timed step, the median of the per-step predictions against
the median step. The pieces keep the slowest rank's compute (layer passes, optimizer tails) and
the collectives as the last rank to reach them saw them; ZeRO-1 plans time their own sharded
tail; ZeRO-2/3 plans time FSDP2's per-unit gather and reduce-scatter directly, and their
tail over DTensor shards. Every step is also split into phases on every rank (forward, backward, the gradient
reduction's wait, optimizer, rest of the tail; ``measured_phases_s``), set beside the predicted
parts (``predicted_phases_s``). Nothing is fitted on the plans. The prediction from the first
profile alone is reported beside (``mape_profile_before``). Writes validate.json (``runs``: the
results; top-level ``mape``, ``kendall_tau`` and ``plans`` are the last run's; ``summary``) and
validate.png (last run) to bench/results/latest/ (``--out DIR`` to choose the folder;
``--update`` rewrites the committed bench/results/validate.json and validate.png). ``--append``
adds this invocation's runs to the ones already in the committed bench/results/validate.json
(runs in a row taken one invocation at a time, each short).

    python bench/validate.py [--runs 3] [--append] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json

from meshmorph.cli.validate import report
from meshmorph.profile.validate import ValidateConfig, run_validate
from results_path import Outputs, wrote

OUTPUTS = Outputs("bench/results/validate.json", "bench/results/validate.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="validate runs in a row (default 3)")
    parser.add_argument("--plans", type=int, default=8, help="plans per run (default 8)")
    parser.add_argument("--nproc", type=int, default=2, help="processes (default 2)")
    parser.add_argument("--append", action="store_true",
                        help="keep the runs already in the committed validate.json")
    parser.add_argument("--nice", type=int, default=0, help="priority increment of the processes")
    parser.add_argument("--repeats", type=int, default=7, help="timed steps per plan (default 7)")
    parser.add_argument("--full-profile", action="store_true",
                        help="choose the plans from a full profile (default: the quick one)")
    OUTPUTS.add_args(parser)
    args = parser.parse_args()
    paths = OUTPUTS.paths(args)
    path, committed = paths["validate.json"], OUTPUTS.committed_path()
    runs = (json.loads(committed.read_text()).get("runs", [])
            if args.append and committed.exists() else [])
    for index in range(args.runs):
        result = run_validate(ValidateConfig(num_plans=args.plans, nproc=args.nproc,
                                               nice=args.nice, repeats=args.repeats,
                                               quick_profile=not args.full_profile))
        png = paths["validate.png"] if index == args.runs - 1 else None
        report(result, json_path=None, png_path=png)
        runs.append(result)
    summary = [{"mape": r["mape"], "kendall_tau": r["kendall_tau"], "in_range": r["in_range"],
                "mape_profile_before": r.get("mape_profile_before"),
                "kendall_tau_profile_before": r.get("kendall_tau_profile_before"),
                "load_avg_profile": r["load_avg_profile"], "load_avg_plans": r.get("load_avg_plans"),
                "when": r["when"]} for r in runs]
    out = {**runs[-1], "summary": summary, "runs": runs}
    path.write_text(json.dumps(out, indent=1) + "\n")
    for i, row in enumerate(summary):
        print(f"run {i + 1}: MAPE {row['mape']:.1f}%  Kendall tau {row['kendall_tau']:.3f}  "
              f"in range {row['in_range']}  load {row['load_avg_profile']:.2f}  {row['when']}")
    wrote(*paths.values())


if __name__ == "__main__":
    main()
