"""Float8 training steps measured on one GPU beside the cost model: each fp8 recipe against bf16.

The measurements come from bench/gpu_suite.py's step section, one process per dtype and recipe,
compiled, on one GPU (the committed ones: an H200, torch 2.11, torchao 0.17):

    for r in bf16 tensorwise rowwise rowwise_with_gw_hp; do
      d=fp8; [ $r = bf16 ] && d=bf16
      python bench/gpu_suite.py --sections step --models gpt3-1.3b --modes compile \\
        --micro-batches 8 --dtype $d --fp8-scaling ${r/bf16/tensorwise} --out runs/step_$r.json
    done
    # and --models examples/configs/llama3-8b-8l.json --seq-len 8192 --micro-batches 1
    python bench/gpu_fp8.py --from runs/*.json --update

Without ``--from`` the script reads the committed bench/results/gpu_fp8.json and prices every
case again with the cost model as it is now (no GPU needed): measured and predicted step, their
ratio, and each recipe's gain over bf16 measured and predicted. tests/unit/test_fp8_measured.py
holds the cost model to these figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from gpu_suite import make_plan  # noqa: E402
from meshmorph.cost.coefficients import CostCoefficients  # noqa: E402
from meshmorph.cost.estimate import GIB  # noqa: E402
from meshmorph.cost.model import CostModel  # noqa: E402
from meshmorph.cost.rank_terms import device_reserve_bytes  # noqa: E402
from meshmorph.spec import load_model, parse_cluster  # noqa: E402
from results_path import Outputs, shown  # noqa: E402

OUTPUTS = Outputs("bench/results/gpu_fp8.json")
CONFIGS = ROOT / "examples" / "configs"
"""Where a model given to gpu_suite as a config file is committed (by the file's name)."""
CASE_FIELDS = ("model", "dtype", "micro_batch", "num_microbatches", "seq_len", "gpu",
               "measured_step_s", "measured_step_min_s", "measured_step_max_s", "measured_mfu",
               "measured_case_peak_gib", "predicted_step_s", "predicted_allocated_gib")
"""What each measured case keeps from gpu_suite's record (its prediction as of that run too)."""


def collect(paths: list[Path]) -> dict[str, Any]:
    """The results file from gpu_suite outputs: one entry per compiled step case that ran."""
    runs = []
    for path in paths:
        data = json.loads(path.read_text())
        meta, args = data["meta"], data["meta"]["args"]
        source = args["models"][0]
        if source.endswith(".json"):
            source = str((CONFIGS / Path(source).name).relative_to(ROOT))
        for case in data["sections"]["step"]["cases"]:
            if case.get("status") != "ok":
                continue
            kept = {key: case.get(key) for key in CASE_FIELDS}
            runs.append(kept | {
                "source": source, "fp8_scaling": case["plan"].get("fp8_scaling", "tensorwise"),
                "compile": case["mode"] == "compile",
                "kernel_ms_per_step": case.get("profile", {}).get("kernel_ms_per_step"),
                "device": meta["device"], "torch": meta["torch"], "started": meta["started"]})
    return {"runs": sorted(runs, key=lambda r: (r["source"], r["dtype"] != "bf16",
                                                r["fp8_scaling"]))}


def reprice(run: dict[str, Any], coef: CostCoefficients | None = None) -> tuple[float, float]:
    """The cost model's step time (s) and peak allocated memory (GiB, without the CUDA context
    and the allocator's slack, as gpu_suite compares it) now, for a measured case (the suite's
    one-device plan)."""
    spec = load_model(run["source"], run["seq_len"])
    plan = make_plan(spec, run["micro_batch"], run["num_microbatches"], run["dtype"],
                     compile=run["compile"], fp8_scaling=run["fp8_scaling"])
    cost = CostModel(spec, parse_cluster(f"{run['gpu']}:1x1"), coef or CostCoefficients())
    estimate = cost.estimate(plan)
    allocated = estimate.memory[0].total - device_reserve_bytes(cost, cost.default_gpu())
    return estimate.step_time_s, allocated / GIB


def compare(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per case: measured and predicted step, their ratio, the gain over the same model's bf16
    case, measured and predicted, and predicted over measured peak allocated memory."""
    rows = []
    for run in results["runs"]:
        step, allocated = reprice(run)
        rows.append({"case": run, "predicted_s": step, "ratio": step / run["measured_step_s"],
                     "memory_ratio": allocated / run["measured_case_peak_gib"]})
    bf16 = {row["case"]["source"]: row for row in rows if row["case"]["dtype"] == "bf16"}
    for row in rows:
        run, base = row["case"], bf16.get(row["case"]["source"])
        if base is not None:
            row["gain_measured"] = base["case"]["measured_step_s"] / run["measured_step_s"]
            row["gain_predicted"] = base["predicted_s"] / row["predicted_s"]
    return rows


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [f"{'model':14s} {'recipe':19s} {'meas ms':>8s} {'pred ms':>8s} {'p/m':>5s} "
             f"{'gain meas':>9s} {'gain pred':>9s} {'peak GiB':>8s} {'p/m':>5s}"]
    for row in rows:
        run = row["case"]
        recipe = "bf16" if run["dtype"] == "bf16" else run["fp8_scaling"]
        lines.append(f"{run['model']:14s} {recipe:19s} {run['measured_step_s'] * 1e3:8.1f} "
                     f"{row['predicted_s'] * 1e3:8.1f} {row['ratio']:5.2f} "
                     f"{row.get('gain_measured', 0):9.3f} {row.get('gain_predicted', 0):9.3f} "
                     f"{run['measured_case_peak_gib']:8.1f} {row['memory_ratio']:5.2f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="sources", nargs="+", type=Path, default=None,
                        help="gpu_suite output JSONs to collect (default: read the committed "
                             "results)")
    OUTPUTS.add_args(parser)
    args = parser.parse_args(argv)
    results = (collect(args.sources) if args.sources
               else json.loads(OUTPUTS.committed_path().read_text()))
    rows = compare(results)
    for line in table(rows):
        print(line)
    out = OUTPUTS.path(args)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {shown(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
