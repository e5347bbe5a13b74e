"""Accuracy of the cost model on this machine: ``meshmorph validate`` three times in a row.

Each run profiles first (full settings: GEMMs, the four collectives fitted to alpha-beta,
FSDP2's per-unit gather and reduce-scatter, per-layer forward and backward inside whole passes of
gpt-small at seq 64 for micro-batches 1, 2 and 4, the optimizer tail; 2 processes at once), then
predicts every candidate plan (dp 2 with ZeRO 0-3 and pp 2 with 1F1B and GPipe, micro-batch 1, 2
or 4, recompute none or full) from that profile, runs the 8 whose predictions lie furthest apart
on 2 gloo processes in one spawned job and compares. Nothing is fitted on the plans. Writes
bench/results/validate.json (``runs``: the results, each with ``mape``, ``kendall_tau``,
``plans``; top-level ``mape``, ``kendall_tau`` and ``plans`` are the last run's) and
bench/results/validate.png (last run). ``--append`` adds this invocation's runs to the ones
already in the file (runs in a row taken one invocation at a time).

    python bench/validate.py [--runs 3] [--append]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from meshmorph.predict.validate import ValidateConfig, report, run_validate

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="validate runs in a row (default 3)")
    parser.add_argument("--plans", type=int, default=8, help="plans per run (default 8)")
    parser.add_argument("--nproc", type=int, default=2, help="processes (default 2)")
    parser.add_argument("--append", action="store_true",
                        help="keep the runs already in bench/results/validate.json")
    parser.add_argument("--nice", type=int, default=0, help="priority increment of the processes")
    args = parser.parse_args()
    path = RESULTS / "validate.json"
    runs = json.loads(path.read_text()).get("runs", []) if args.append and path.exists() else []
    for index in range(args.runs):
        result = run_validate(ValidateConfig(num_plans=args.plans, nproc=args.nproc,
                                               nice=args.nice))
        png = RESULTS / "validate.png" if index == args.runs - 1 else None
        report(result, json_path=None, png_path=png)
        runs.append(result)
    summary = [{"mape": r["mape"], "kendall_tau": r["kendall_tau"], "in_range": r["in_range"],
                "load_avg_profile": r["load_avg_profile"], "when": r["when"]} for r in runs]
    out = {**runs[-1], "summary": summary, "runs": runs}
    path.write_text(json.dumps(out, indent=1) + "\n")
    for i, row in enumerate(summary):
        print(f"run {i + 1}: MAPE {row['mape']:.1f}%  Kendall tau {row['kendall_tau']:.3f}  "
              f"in range {row['in_range']}  load {row['load_avg_profile']:.2f}  {row['when']}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
