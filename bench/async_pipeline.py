"""Asynchronous pipeline training on scikit-learn's digits: synchronous 1F1B, stale, stashing,
PipeDream-2BW, momentum-SGD prediction (SpecTrain) and Adam prediction, 4 stages on 4 gloo
processes, the same seeds and steps for every mode.

One torchrun job (4 processes, one MLP layer per stage) trains every mode for every seed and
measures test accuracy and steps/s; this script writes bench/results/latest/async_pipeline.json
(``--out PATH`` to choose, ``--update`` for the committed bench/results/async_pipeline.json) with
keys ``sync``, ``stale``, ``stash``, ``predict_sgd``, ``predict_adam`` (each
``{"accuracy": mean over seeds, "steps_per_s": median}``; also ``2bw``, ``sync_adam``,
``stale_adam`` and every run's figures) and prints a table.

Settings where staleness hurts: momentum SGD at lr 0.015 with momentum 0.9 over 500 steps of 32
samples (the first stage runs 3 updates stale, and momentum 0.9 multiplies what a delay costs);
Adam at lr 0.003 over its first 200 steps (later on, or at lower rates, stale Adam catches up;
at lr 0.02 over 500 steps staleness hurts too, but Adam's direction flips too often there for
extrapolation: prediction did worse than stale weights, 0.747 vs 0.846). A step is one batch of 32: synchronous 1F1B cuts it into 4 micro-batches
of 8 and flushes; the asynchronous modes send it as one micro-batch and step per micro-batch
(2BW cuts it into 4 and steps per batch without flushing).

    python bench/async_pipeline.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from results_path import Outputs, wrote

OUTPUTS = Outputs("bench/results/async_pipeline.json")
MODES = ["sync", "stale", "stash", "2bw", "predict_sgd", "sync_adam", "stale_adam", "predict_adam"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--lr", type=float, default=0.015)
    parser.add_argument("--adam-lr", type=float, default=0.003)
    parser.add_argument("--adam-steps", type=int, default=200)
    OUTPUTS.add_args(parser)
    args = parser.parse_args()
    out = OUTPUTS.path(args)
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "rows.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4",
               "-m", "meshmorph.demos.digits", "--modes", *MODES,
               "--seeds", *map(str, args.seeds), "--steps", str(args.steps),
               "--lr", str(args.lr), "--adam-lr", str(args.adam_lr),
               "--adam-steps", str(args.adam_steps), "--out", str(raw)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(cmd, check=True, env=env)
        rows = json.loads(raw.read_text())["rows"]
    summary: dict[str, object] = {}
    for mode in MODES:
        runs = [r for r in rows if r["mode"] == mode]
        summary[mode] = {"accuracy": statistics.fmean(r["accuracy"] for r in runs),
                         "steps_per_s": statistics.median(r["steps_per_s"] for r in runs),
                         "accuracy_by_seed": [r["accuracy"] for r in runs],
                         "guard_switched": [r["switched_at"] for r in runs],
                         "guard_ratio_median": [r["guard_ratio_median"] for r in runs],
                         "guard_ratio_max": [r["guard_ratio_max"] for r in runs]}
    summary["settings"] = {"stages": 4, "processes": 4, "backend": "gloo", "seeds": args.seeds,
                           "steps": args.steps, "batch_size": 32, "sync_microbatches": 4,
                           "sgd": {"lr": args.lr, "momentum": 0.9},
                           "adam": {"lr": args.adam_lr, "betas": [0.9, 0.999],
                                    "steps": args.adam_steps},
                           "model": "MLP 64-128-128-128-10, one Linear per stage",
                           "data": "sklearn load_digits, stratified 80/20 split (360 test)"}
    out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\n{'mode':14s} {'optimizer':10s} {'accuracy':>9s} {'by seed':>24s} {'steps/s':>8s}")
    for mode in MODES:
        row = summary[mode]
        assert isinstance(row, dict)
        seeds = " ".join(f"{a:.3f}" for a in row["accuracy_by_seed"])
        print(f"{mode:14s} {'adam' if 'adam' in mode else 'sgd+mom':10s} "
              f"{row['accuracy']:9.4f} {seeds:>24s} {row['steps_per_s']:8.1f}")
    for mode in ("predict_sgd", "predict_adam"):
        row = summary[mode]
        assert isinstance(row, dict)
        medians = " ".join(f"{r:.2f}" for r in row["guard_ratio_median"] if r is not None)
        worst = " ".join(f"{r:.2f}" for r in row["guard_ratio_max"] if r is not None)
        print(f"{mode}: prediction error ratio ||W_pred - W_now|| / ||W_fwd - W_now|| at the "
              f"guard checks, median by seed {medians}, worst {worst} (threshold 1.0; flushed "
              f"from batch {row['guard_switched']})")
    wrote(out)


if __name__ == "__main__":
    main()
