"""The published transient-cloud measurements the predictors are fitted to, as one packaged file.

``data/cloud_measurements.json`` holds the parts of CM-DARE (Li, Walls, Guo, ICDCS 2020;
cake-lab/CM-DARE, Apache-2.0) and ICAC 2019 (Li, Walls, Xu, Guo; cake-lab/transient-deep-learning,
Apache-2.0) that meshmorph fits: single-worker and cluster training speeds, VM lifetimes and
revocation counts, VM start-up, server request, training restart and checkpoint times, and AWS
spot-trace loss rates (skypilot-org/spot-traces, summary statistics only). ``import_reference``
rebuilds it from the reference CSVs (``python -m meshmorph.predict.measurements DIR``).
"""

from __future__ import annotations

import csv
import json
import statistics
import sys
from collections import defaultdict
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

FINAL = "ICDCS final figure"
"""Prefix of the published (final) series in the revocation-count files."""


def _rows(folder: Path, name: str) -> list[dict[str, str]]:
    with (folder / name).open(newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def _single_worker(folder: Path) -> list[dict[str, Any]]:
    groups: dict[tuple[str, str], list[dict[str, str]]] = defaultdict(list)
    tensors: dict[str, int] = {}
    for row in _rows(folder, "cmdare_single_worker_speed_samples.csv"):
        groups[(row["gpu"], row["model"])].append(row)
        if row["n_tensors"]:  # a few P100 rows leave it blank; the model is the same on K80
            tensors[row["model"]] = int(row["n_tensors"])
    return [{"gpu": gpu, "model": model,
             "gpu_peak_tflops": float(rows[0]["gpu_peak_tflops_as_given"]),
             "model_flops": float(rows[0]["model_flops_as_given"]),
             "n_parameters": int(rows[0]["n_parameters"]), "n_tensors": tensors[model],
             "step_time_s": statistics.median(float(r["step_time_s"]) for r in rows),
             "samples": len(rows)} for (gpu, model), rows in groups.items()]


def _revocation_counts(folder: Path, name: str) -> dict[str, list[int]]:
    counts: dict[str, list[int]] = defaultdict(list)
    for row in _rows(folder, name):
        if row["variant"].startswith(FINAL):
            counts[row["server_type"]].append(int(row["n_revocations"]))
    return dict(counts)


def _revocations_by_region(folder: Path) -> dict[str, dict[str, dict[str, Any]]]:
    """Per GPU and region: VMs launched and revocations in each hour of age (from the published
    per-region lifetime CDFs; the regions partition the VMs behind the pooled counts)."""
    ended: dict[tuple[str, str], dict[int, int]] = defaultdict(dict)
    launched: dict[tuple[str, str], int] = {}
    for row in _rows(folder, "cmdare_lifetime_cdf_by_region.csv"):
        key = (row["gpu"], row["region"])
        ended[key][int(row["lifetime_upper_bound_h"])] = int(row["n_ended_implied"])
        launched[key] = int(row["n_instances_inferred"])
    out: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for (gpu, region), by_hour in ended.items():
        cumulative = [0] + [by_hour[h] for h in range(1, 25)]  # h = 25 adds the capped VMs
        out[gpu][region] = {"launched": launched[(gpu, region)],
                            "revocations_by_hour": [b - a for a, b in
                                                    zip(cumulative, cumulative[1:], strict=False)]}
    return dict(out)


def import_reference(folder: Path) -> dict[str, Any]:
    """The packaged measurement file's content, from the reference CSVs in ``folder``."""
    launched = {row["server_type"]: int(row["n_instances_launched"])
                for row in _rows(folder, "cmdare_revocations_by_hours_since_start.csv")
                if row["variant"].startswith(FINAL)}
    startup: dict[str, list[float]] = defaultdict(list)
    for row in _rows(folder, "cmdare_vm_startup_time.csv"):
        if row["scenario"] == "new VM":
            startup[row["pricing"]].append(float(row["total_s"]))
    restart: dict[str, list[float]] = defaultdict(list)
    for row in _rows(folder, "cmdare_training_restart_cold_warm.csv"):
        restart[row["start_type"]].append(float(row["restart_time_s"]))
    feb2019: dict[str, list[list[float]]] = defaultdict(list)
    for row in _rows(folder, "icac_vm_lifetimes_feb2019.csv"):
        feb2019[row["gpu"]].append([float(row["lifetime_h"]), int(row["reached_24h_cap"])])
    return {
        "sources": {
            "cmdare": "Li, Walls, Guo, ICDCS 2020 (arXiv 2004.03072); cake-lab/CM-DARE @ 263b7f1, "
                      "Apache-2.0",
            "icac2019": "Li, Walls, Xu, Guo, ICAC 2019 (arXiv 1903.00045); "
                        "cake-lab/transient-deep-learning @ 87c6717, Apache-2.0",
            "spot_traces": "skypilot-org/spot-traces @ 221da1a (summary statistics only)",
        },
        "single_worker": _single_worker(folder),
        "cluster_scaling": [
            {"gpu": r["gpu"], "parameter_servers": int(r["n_parameter_servers"]),
             "model": r["model"], "workers": int(r["n_workers"]),
             "speed_steps_per_s": float(r["figure_speed_mean_steps_per_s"])}
            for r in _rows(folder, "cmdare_cluster_scaling_speed.csv")],
        "k80_lifetimes_h": [[float(r["lifetime_h"]), int(r["censored_at_24h_cap"])]
                            for r in _rows(folder, "cmdare_vm_lifetimes_128.csv")],
        "revocations_by_hours_since_start": _revocation_counts(
            folder, "cmdare_revocations_by_hours_since_start.csv"),
        "instances_launched": launched,
        "revocations_by_hour_of_day": _revocation_counts(
            folder, "cmdare_revocations_by_hour_of_day.csv"),
        "revocations_by_region": _revocations_by_region(folder),
        "icac_feb2019_lifetimes_h": dict(feb2019),
        "vm_startup_s": dict(startup),
        "server_request_s": {f"{r['requested_server']}/{r['request_timing']}":
                             [float(r["mean_time_s"]), float(r["std_time_s"])]
                             for r in _rows(folder, "cmdare_server_request_time_summary.csv")},
        "training_restart_s": dict(restart),
        "checkpoint_mb_s": [[float(r["checkpoint_size_MB"]), float(r["total_checkpoint_s"])]
                            for r in _rows(folder, "cmdare_checkpoint_samples.csv")],
        "aws_spot_lost_per_instance_hour": [
            {"instance_type": r["instance_type"], "zone": r["zone"],
             "duration_h": float(r["duration_h"]),
             "lost_per_instance_hour": float(r["instances_lost_per_instance_hour"])}
            for r in _rows(folder, "spot_trace_summaries_derived.csv")
            if r["cloud"] == "AWS" and r["trace_kind"] in ("availability", "preemption")
            and r["instance_type"].startswith("p")],
    }


@cache
def packaged_json(name: str) -> Any:
    """A JSON file of the ``meshmorph.data`` package (read once)."""
    return json.loads(resources.files("meshmorph.data").joinpath(name).read_text())


def measurements() -> dict[str, Any]:
    """The packaged measurements (read once)."""
    return packaged_json("cloud_measurements.json")


if __name__ == "__main__":
    out = Path(__file__).resolve().parents[1] / "data" / "cloud_measurements.json"
    out.write_text(json.dumps(import_reference(Path(sys.argv[1])), indent=1) + "\n")
    print(f"wrote {out}")
