"""The fits behind ``meshmorph simulate``, and CM-DARE's training speeds reproduced.

Section 1, a reproduction only (nothing in meshmorph calls it: ``simulate`` takes its step time
from meshmorph's own cost model and planner, which model hybrid-parallel LLM training, not
TensorFlow 1.10 parameter-server CNNs): CM-DARE's 40 single-worker points (20 CNNs x K80/P100)
and 96 cluster points (1-8 workers, 1-2 parameter servers) from physics-first features:

    step_s = c0 + c1 FLOPs/peak + c2 tensors 1e12/peak + c3 8 params/B_net + c4 4 params/B_hbm
    cluster_steps_per_s = n / (step_s^p + (n s / k)^p)^(1/p),  s = a0 + a1 8 params/B_net + a2 tensors

(c by non-negative least squares on relative error, ``scipy.optimize.nnls``; a and p by least
squares on log error, ``scipy.optimize.least_squares``). Leave-one-out refits everything
without the point left out (the worker terms, then the server terms on that worker fit), and
leave-one-model-out leaves out every point of that CNN on that GPU (its single-worker speed is
otherwise seen by the worker fit while its cluster speeds are predicted).

Section 2: the revocation hazard by VM age fitted to CM-DARE's published counts, against the
published CDF and, held out, each region against a fit to the other three (``revocation.py``).

Section 3: every packaged spot fit with its 95% intervals (``spot_data.fit_report``) and the
chart of the fits beside their data (docs/img/spot_fits.png).

Run: ``python bench/cmdare_fit.py``; writes cmdare_fit.json, cmdare_fit.png, revocation_fit.json,
revocation_hazard.png, revocation_spot_fits.json and spot_fits.png to bench/results/latest/
(``--out DIR`` to choose the folder); ``--update`` rewrites the committed ones (bench/results/,
docs/img/spot_fits.png).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import least_squares, nnls

from meshmorph.predict.measurements import measurements
from meshmorph.predict.revocation import revocation_report
from meshmorph.predict.spot_data import fit_report, preemption_rates
from meshmorph.spec.gpus import gpu
from results_path import Outputs, wrote
from spot_charts import write_hazard_chart, write_spot_fit_chart

OUTPUTS = Outputs("bench/results/cmdare_fit.json", "bench/results/cmdare_fit.png",
                  "bench/results/revocation_fit.json", "bench/results/revocation_hazard.png",
                  "bench/results/revocation_spot_fits.json", "docs/img/spot_fits.png")
NETWORK_BYTES_PER_S = 10e9 / 8
"""GCE VM NIC bandwidth assumed in the features (10 Gb/s; the coefficients absorb the real one)."""
FEATURES = ("fixed", "flops_over_peak", "tensors_over_peak", "param_bytes_over_network",
            "param_bytes_over_hbm")
SERVER_START = np.array([1e-3, 1.0, 1e-4, 4.0])
"""a0, a1, a2, p where the server fit starts."""


@dataclass(frozen=True, slots=True)
class SpeedPoint:
    """One measured configuration."""

    gpu: str
    """Catalog GPU (``k80``, ``p100``)."""
    model: str
    """CNN name as in CM-DARE."""
    peak_flops: float
    """GPU peak FLOP/s as CM-DARE gives it."""
    model_flops: float
    """Model FLOPs as CM-DARE gives them (their counting convention)."""
    params: int
    """Trainable parameters."""
    tensors: int
    """Trainable tensors."""
    workers: int = 1
    """Workers."""
    parameter_servers: int = 1
    """Parameter servers."""
    steps_per_s: float = 0.0
    """Measured speed (the cluster's global steps per second)."""
    single: bool = True
    """A single-worker sample (else a cluster figure)."""

    def features(self) -> np.ndarray:
        hbm = gpu(self.gpu).hbm_gbps * 1e9
        return np.array([1.0, self.model_flops / self.peak_flops,
                         self.tensors * 1e12 / self.peak_flops,
                         8 * self.params / NETWORK_BYTES_PER_S, 4 * self.params / hbm])


def step_time_s(worker: np.ndarray, point: SpeedPoint) -> float:
    return float(point.features() @ worker)


def steps_per_s(worker: np.ndarray, server: np.ndarray, point: SpeedPoint) -> float:
    a0, a1, a2, power = server
    load = point.workers * (a0 + a1 * 8 * point.params / NETWORK_BYTES_PER_S
                            + a2 * point.tensors) / point.parameter_servers
    return point.workers / (step_time_s(worker, point) ** power + load**power) ** (1 / power)


def points() -> list[SpeedPoint]:
    """The 40 single-worker points, then the 96 cluster points."""
    single = [SpeedPoint(gpu=r["gpu"].lower(), model=r["model"],
                         peak_flops=r["gpu_peak_tflops"] * 1e12, model_flops=r["model_flops"],
                         params=r["n_parameters"], tensors=r["n_tensors"],
                         steps_per_s=1.0 / r["step_time_s"])
              for r in measurements()["single_worker"]]
    by_model = {(p.gpu, p.model): p for p in single}
    cluster = []
    for r in measurements()["cluster_scaling"]:
        base = by_model[(r["gpu"].lower(), r["model"])]
        cluster.append(SpeedPoint(gpu=base.gpu, model=base.model, peak_flops=base.peak_flops,
                                  model_flops=base.model_flops, params=base.params,
                                  tensors=base.tensors, workers=r["workers"],
                                  parameter_servers=r["parameter_servers"],
                                  steps_per_s=r["speed_steps_per_s"], single=False))
    return single + cluster


def fit(data: list[SpeedPoint]) -> tuple[np.ndarray, np.ndarray]:
    """(worker, server) coefficients fitted to ``data``: the worker terms on its single-worker
    points (relative error, non-negative), the server terms on its cluster points (log error)."""
    single = [p for p in data if p.single]
    times = np.array([1.0 / p.steps_per_s for p in single])
    worker, _ = nnls(np.array([p.features() for p in single]) / times[:, None],
                     np.ones(len(single)))
    cluster = [p for p in data if not p.single]
    measured = np.log([p.steps_per_s for p in cluster])
    # the formula of steps_per_s over all cluster points at once
    step = np.array([step_time_s(worker, p) for p in cluster])
    workers = np.array([p.workers for p in cluster], dtype=float)
    servers = np.array([p.parameter_servers for p in cluster], dtype=float)
    net = np.array([8 * p.params / NETWORK_BYTES_PER_S for p in cluster])
    tensors = np.array([p.tensors for p in cluster], dtype=float)

    def residuals(theta: np.ndarray) -> np.ndarray:
        a0, a1, a2, power = theta
        load = workers * (a0 + a1 * net + a2 * tensors) / servers
        return np.log(workers) - np.log(step**power + load**power) / power - measured

    server = least_squares(residuals, SERVER_START, bounds=([0, 0, 0, 1], np.inf)).x
    return worker, server


def predict(worker: np.ndarray, server: np.ndarray, point: SpeedPoint) -> float:
    return 1.0 / step_time_s(worker, point) if point.single else steps_per_s(worker, server, point)


def held_out(data: list[SpeedPoint], group: bool) -> list[float]:
    """Each point predicted by a model refitted without it (``group``: without every point of
    its CNN on its GPU)."""
    out, by_group = [], {}
    for i, point in enumerate(data):
        key = (point.gpu, point.model) if group else i
        if key not in by_group:  # one refit per left-out group
            by_group[key] = fit([q for j, q in enumerate(data) if j != i and not (
                group and (q.gpu, q.model) == key)])
        out.append(predict(*by_group[key], point))
    return out


def mape(predicted: list[float], data: list[SpeedPoint]) -> float:
    return float(np.mean([abs(p - q.steps_per_s) / q.steps_per_s
                          for p, q in zip(predicted, data, strict=True)]))


def speed_report() -> dict[str, Any]:
    """In-sample, leave-one-out and leave-one-model-out MAPE, per set."""
    data = points()
    worker, server = fit(data)
    sample = [predict(worker, server, p) for p in data]
    loo, lomo = held_out(data, group=False), held_out(data, group=True)
    report: dict[str, Any] = {"features": list(FEATURES), "worker_coefficients": worker.tolist(),
                              "server_coefficients_a0_a1_a2_p": server.tolist()}
    for name, keep in (("single_worker", True), ("cluster", False)):
        index = [i for i, p in enumerate(data) if p.single == keep]
        subset = [data[i] for i in index]
        report[name] = {"points": len(index),
                        "mape_in_sample": mape([sample[i] for i in index], subset),
                        "mape_leave_one_out": mape([loo[i] for i in index], subset),
                        "mape_leave_one_model_out": mape([lomo[i] for i in index], subset)}
    report["mape_leave_one_out_all"] = mape(loo, data)
    report["mape_leave_one_model_out_all"] = mape(lomo, data)
    report["predictions"] = [
        {"gpu": p.gpu, "model": p.model, "workers": p.workers,
         "parameter_servers": p.parameter_servers, "measured_steps_per_s": p.steps_per_s,
         "loo_steps_per_s": a, "lomo_steps_per_s": b}
        for p, a, b in zip(data, loo, lomo, strict=True)]
    return report


def speed_chart(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    for single, colour in ((True, "#2e7d32"), (False, "#1565c0")):
        chosen = [p for p in report["predictions"] if (p["workers"] == 1
                                                      and p["parameter_servers"] == 1) == single]
        ax.scatter([p["measured_steps_per_s"] for p in chosen],
                   [p["loo_steps_per_s"] for p in chosen], s=12, color=colour,
                   label="one worker" if single else "clusters")
    ax.plot([0.3, 200], [0.3, 200], color="grey", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured steps/s (CM-DARE)")
    ax.set_ylabel("predicted steps/s (leave-one-out, refitted)")
    ax.set_title(f"LOO MAPE {report['mape_leave_one_out_all']:.1%}, leave-one-model-out "
                 f"{report['mape_leave_one_model_out_all']:.1%}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    OUTPUTS.add_args(parser)
    args = parser.parse_args()
    paths = OUTPUTS.paths(args)
    started = time.perf_counter()
    speed = speed_report()
    speed["fit_and_held_out_time_s"] = time.perf_counter() - started
    paths["cmdare_fit.json"].write_text(json.dumps(speed, indent=1) + "\n")
    speed_chart(speed, paths["cmdare_fit.png"])
    for name in ("single_worker", "cluster"):
        s = speed[name]
        print(f"speed {name} ({s['points']} points): in-sample {s['mape_in_sample']:.1%}, "
              f"leave-one-out {s['mape_leave_one_out']:.1%}, leave-one-model-out "
              f"{s['mape_leave_one_model_out']:.1%}")
    revocation = revocation_report()
    paths["revocation_fit.json"].write_text(json.dumps(revocation, indent=1) + "\n")
    write_hazard_chart(paths["revocation_hazard.png"])
    for name, gaps in revocation["leave_one_region_out_max_cdf_gap"].items():
        print(f"revocation {name} 2019: largest CDF gap, each region vs the other three: "
              + ", ".join(f"{r} {g:.2f}" for r, g in gaps.items()))
    spot = fit_report()
    paths["revocation_spot_fits.json"].write_text(json.dumps(spot, indent=1) + "\n")
    write_spot_fit_chart(preemption_rates(), paths["spot_fits.png"])
    for row in spot["preemption_rates_per_vm_h"]:
        print(f"preemptions per VM-hour {row['set']}: {row['rate']:.3f} "
              f"({row['ci95'][0]:.3f}-{row['ci95'][1]:.3f})")
    wrote(*paths.values())


if __name__ == "__main__":
    main()
