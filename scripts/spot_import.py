"""Build ``data/spot_data.json`` from the public spot references (run by a maintainer, never at
run time): ``python scripts/spot_import.py SPOT_DIR TRANSIENT_DIR``.

``SPOT_DIR`` holds the SkyNomad (NSDI '27, Apache-2.0) and Bamboo (NSDI '23, MIT) files,
``TRANSIENT_DIR`` the spot-trace summaries derived from skypilot-org/spot-traces (statistics only:
that repository carries no licence). What is kept:

- availability: the GCP H100 probes (13 zones, every 10 min, Oct 2025: how many of 16 spot VMs
  launched, one base-17 digit per round), the AWS L4 run's per-zone capacity probes (Dec 2025,
  one character per tick: 1 / 0 / - not probed yet), and the AWS V100 availability summaries
  (Feb 2023: share of ticks available, periods, mean period lengths);
- lifetimes: VM lifetimes of the Bamboo AWS p3 (V100) and g4dn (T4) groups and of the L4 run
  (launch to preemption; a terminate or the end of the run censors), the Bamboo GCP A100 / V100
  managed groups as preemptions and VM-hours, the AWS V100 1-node preemption summaries (2023);
- prices: the a3-highgpu-8g spot and on-demand price per region (GCP Billing Catalog,
  2025-10-23), the g6.12xlarge prices per zone at the L4 run's start, p3.2xlarge spot means per
  zone (2023).
"""

from __future__ import annotations

import csv
import datetime as dt
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from meshmorph.predict.traces import DIGITS

SKYNOMAD = ("andylizf/skynomad-artifact @ 62b9aaa (SkyNomad, NSDI '27), Apache-2.0; "
            "the traces are released under the same licence (its NOTICE)")
BAMBOO = "uclasystem/bamboo @ 8080929 (Bamboo, NSDI '23), MIT, Copyright (c) 2022 UCLASystem"
SKYPILOT = ("skypilot-org/spot-traces @ 221da1a (Can't Be Late, NSDI '24): summary statistics "
            "computed from the traces only (the repository has no licence file)")


def _csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle, skipinitialspace=True))


def _utc(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))


def h100_probes(spot: Path) -> dict[str, Any]:
    """The 2,104 probe rounds per zone, split where rounds are missing."""
    rows = _csv(spot / "skynomad" / "h100_gcp_probes_2025-10.csv")
    rounds = sorted({r["scheduled_at_utc"] for r in rows})
    counts: dict[str, dict[str, int]] = defaultdict(dict)
    gpu_price: dict[str, float] = {}
    for r in rows:
        counts[r["zone"]][r["scheduled_at_utc"]] = int(r["instances_created"])
        if r["gpu_spot_price_usd_per_gpu_hour"]:
            gpu_price[r["zone"]] = float(r["gpu_spot_price_usd_per_gpu_hour"])
    segments, start = [], 0
    for i in range(1, len(rounds) + 1):
        if i == len(rounds) or (_utc(rounds[i]) - _utc(rounds[i - 1])).total_seconds() != 600:
            segments.append({"start_utc": rounds[start],
                             "rounds": {z: "".join(DIGITS[c[t]] for t in rounds[start:i])
                                        for z, c in sorted(counts.items())}})
            start = i
    prices = {}
    for path in sorted((spot / "skynomad" / "gcp_spot_price_cache").glob("*.json")):
        data = json.loads(path.read_text())
        prices[data["region"]] = {"spot_usd_per_h": round(data["price"], 4),
                                  "on_demand_usd_per_h": round(data["on_demand_price"], 4),
                                  "date": data["fetched_at"][:10]}
    return {"gpu": "h100", "cloud": "GCP", "provider": "gcp-spot", "tick_s": 600,
            "requested_gpus": 16, "kind": "counts",
            "about": "every 10 min, 16 spot a3-highgpu-1g (1 x H100 80GB) VMs requested per zone; "
                     "the digit is how many launched (base 17)",
            "source": f"{SKYNOMAD}; data/h100_16_runs (probe rounds 2025-10-04..18)",
            "segments": segments,
            "gpu_spot_usd_per_gpu_h": gpu_price,
            "a3_highgpu_8g_prices": prices}


def l4_run(spot: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(availability, lifetimes) of the AWS g6.12xlarge run: probes per tick, VM lifetimes."""
    folder = spot / "skynomad"
    ticks = _csv(folder / "l4_g6.12xlarge_run_2025-12_ticks.csv")
    zones = [k.removeprefix("probe_") for k in ticks[0] if k.startswith("probe_")]
    t0 = dt.datetime.fromisoformat(ticks[0]["walltime_local"])
    times = [round((dt.datetime.fromisoformat(t["walltime_local"]) - t0).total_seconds())
             for t in ticks]
    probes = {z: "".join(t[f"probe_{z}"] or "-" for t in ticks) for z in zones}
    prices = {z: {"spot_usd_per_h": float(ticks[0][f"spot_price_{z}"]),
                  "on_demand_usd_per_h": float(ticks[0][f"ondemand_price_{z}"]),
                  "date": ticks[0]["walltime_local"][:10]} for z in zones}
    preempted = {(e["zone"], int(e["tick"])) for e in
                 _csv(folder / "l4_g6.12xlarge_run_2025-12_events.csv") if e["event"] == "preemption"}
    lifetimes: dict[str, list[list[float]]] = defaultdict(list)
    start = 0
    for i in range(1, len(ticks) + 1):  # runs of the job's active spot instance
        here = (ticks[start]["active_zone"], ticks[start]["active_type"])
        if i < len(ticks) and (ticks[i]["active_zone"], ticks[i]["active_type"]) == here:
            continue
        if here[1] == "SPOT":  # a preemption of that zone at the run's last tick ends it
            ended = any((here[0], t) in preempted for t in (i - 1, i))
            hours = (times[min(i, len(ticks) - 1)] - times[start]) / 3600
            lifetimes[here[0]].append([round(hours, 4), int(ended)])
        start = i
    about = ("one real SkyNomad run on AWS g6.12xlarge (4 x L4) spot over 10 zones, "
             "2025-12-09/10 (local wall time)")
    availability = {"gpu": "l4", "cloud": "AWS", "provider": "aws-spot", "kind": "probes",
                    "about": about + "; per tick, whether the latest probe found spot capacity",
                    "source": f"{SKYNOMAD}; research/history.jsonl", "tick_times_s": times,
                    "zones": probes, "g6_12xlarge_prices": prices}
    lives = {"gpu": "l4", "cloud": "AWS", "provider": "aws-spot", "kind": "vms",
             "about": about + "; each run of the job's active spot instance (a preemption of "
                              "its zone at the run's end ends it; probe instances' preemptions "
                              "are not lifetimes; otherwise censored)",
             "source": f"{SKYNOMAD}; research/history.jsonl", "zones": dict(lifetimes)}
    return availability, lives


def bamboo_nodes(path: Path, gpu: str, instance: str) -> dict[str, Any]:
    """Node lifetimes of an add/remove event list; nodes alive at the end are censored."""
    added: dict[str, int] = {}
    out, last = [], 0
    for time_ms, event, node in csv.reader(path.open()):
        last = max(last, int(time_ms))
        if event == "add":
            added[node] = int(time_ms)
        elif node in added:
            out.append([round((int(time_ms) - added.pop(node)) / 3.6e6, 4), 1])
    out += [[round((last - start) / 3.6e6, 4), 0] for start in added.values()]
    return {"gpu": gpu, "cloud": "AWS", "provider": "aws-spot", "kind": "vms",
            "about": f"Bamboo's {instance} spot group (2021): each node from add to remove "
                     "(a remove may also be a node the group released: an upper bound)",
            "source": f"{BAMBOO}; traces/{path.name}", "zones": {"not stated": out}}


def bamboo_group(path: Path, gpu: str, zone: str) -> dict[str, Any]:
    """Decreases and VM-hours of a managed group's size log (lines that go back in time are a
    rewritten chunk and skipped)."""
    events, vm_h, prev, latest = 0, 0.0, None, None
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        day, clock, running = (p.strip() for p in line.split(","))
        when = dt.datetime.fromisoformat(f"{day} {clock}")
        if latest is not None and when <= latest:
            continue
        if prev is not None:
            vm_h += prev[1] * (when - prev[0]).total_seconds() / 3600
            events += max(prev[1] - int(running), 0)
        prev, latest = (when, int(running)), when
    return {"gpu": gpu, "cloud": "GCP", "provider": "gcp-preemptible", "kind": "group",
            "about": f"Bamboo's GCP preemptible {gpu.upper()} managed group, {zone}, Dec 2021: "
                     "unit decreases of the running count (an upper bound of preemptions)",
            "source": f"{BAMBOO}; traces/gcloud/{path.name}",
            "zones": {zone: {"events": events, "vm_hours": round(vm_h, 2)}}}


def skypilot_summaries(transient: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """AWS p3.2xlarge (V100) availability (1-node, Feb 2023) and preemption (1-node, Apr 2023)."""
    rows = _csv(transient / "spot_trace_summaries_derived.csv")
    avail, lives = {}, {}
    for r in rows:
        if r["instance_type"] != "p3.2xlarge" or r["target_instances"] != "1":
            continue
        hours, share = float(r["duration_h"]), float(r["fraction_of_ticks_at_target"])
        if r["trace_kind"] == "availability" and r["start_date"] == "2023-02-15":
            avail[r["zone"]] = {"duration_h": hours, "share": share,
                                "up_periods": int(r["n_decrease_events"]),
                                "mean_up_h": float(r["mean_run_at_target_h"]),
                                "mean_down_h": float(r["mean_run_at_zero_h"])}
        elif r["trace_kind"] == "preemption":
            lost, rate = int(r["n_instances_lost"]), float(r["instances_lost_per_instance_hour"])
            lives[r["zone"]] = {"events": lost, "vm_hours": round(lost / rate, 2)}
    common = {"gpu": "v100-16g", "cloud": "AWS", "provider": "aws-spot", "kind": "summary"}
    return ({**common, "about": "p3.2xlarge 1-node availability traces from 2023-02-15 "
                                "(195 s ticks, 1,092 h): share available, periods, mean lengths",
             "source": SKYPILOT, "zones": avail},
            {**common, "kind": "group", "about": "p3.2xlarge 1-node preemption traces from "
                                                 "2023-04-22 (177 h): instances lost, VM-hours",
             "source": SKYPILOT, "zones": lives})


def p3_prices(spot: Path) -> dict[str, Any]:
    series = json.loads((spot / "skynomad" / "v100_spot_prices.json").read_text())
    return {key.split("_")[0]: {"spot_usd_per_h": round(statistics.fmean(v), 4),
                                "spot_min_usd_per_h": min(v), "spot_max_usd_per_h": max(v),
                                "on_demand_usd_per_h": 3.06, "date": "2023-02/03"}
            for key, v in series.items()}


def import_reference(spot: Path, transient: Path) -> dict[str, Any]:
    l4_avail, l4_lives = l4_run(spot)
    v100_avail, v100_lives = skypilot_summaries(transient)
    return {
        "about": "Compact tables derived from public spot measurements for meshmorph.predict; "
                 "each entry names its source and licence. Rebuild: python "
                 "scripts/spot_import.py SPOT_DIR TRANSIENT_DIR",
        "availability": {"h100-gcp-2025-10": h100_probes(spot), "l4-aws-2025-12": l4_avail,
                         "v100-aws-2023-02": v100_avail},
        "lifetimes": {
            "a100-gcp-2021-12": bamboo_group(spot / "bamboo" / "gcloud" / "a100x1-east1b.txt",
                                             "a100-40g", "us-east1-b"),
            "v100-gcp-2021-12": bamboo_group(spot / "bamboo" / "gcloud" / "v100x1-east1c.txt",
                                             "v100-16g", "us-east1-c"),
            "v100-aws-2021": bamboo_nodes(spot / "bamboo" / "p3-trace.csv", "v100-16g",
                                          "p3.2xlarge"),
            "t4-aws-2021": bamboo_nodes(spot / "bamboo" / "g4dn-trace.csv", "t4", "g4dn.xlarge"),
            "v100-aws-2023-04": v100_lives,
            "l4-aws-2025-12": l4_lives,
        },
        "p3_2xlarge_prices": {"source": f"{SKYNOMAD}; v100_spot_prices.json (time-weighted over "
                                        "20,158 ticks of 195 s from 2023-02-15; on-demand list "
                                        "3.06)", "zones": p3_prices(spot)},
    }


if __name__ == "__main__":
    out = Path(__file__).resolve().parents[1] / "data" / "spot_data.json"
    data = import_reference(Path(sys.argv[1]), Path(sys.argv[2]))
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {out} ({out.stat().st_size / 1024:.0f} KiB)")
