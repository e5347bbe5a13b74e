"""CM-DARE's training speeds, predicted from physics-first features and fitted by regression.

One worker and one parameter server (TensorFlow 1.10, CIFAR-10 CNNs on K80/P100):

    step_s = c0                                  fixed per-step cost (input, session, PS round trip)
           + c1 * FLOPs / peak                   compute at the GPU's dense peak
           + c2 * tensors * 1e12 / peak          one kernel sequence per tensor, slower on slower GPUs
           + c3 * 8 * params / B_net             push gradients + pull weights (fp32) over the NIC
           + c4 * 4 * params / B_hbm             weight/gradient traffic through device memory

fitted with non-negative least squares on relative error (scipy ``nnls``). Clusters of n workers and
k parameter servers (asynchronous): each update also costs the parameter servers
``s = a0 + a1 * 8 * params / B_net + a2 * tensors``, shared by the k servers, and the cluster
runs at whichever is slower, the workers or the servers, blended by a p-norm:

    cluster_steps_per_s = n / ((step_s)^p + (n * s / k)^p)^(1/p)

Both are checked by leave-one-out MAPE (``fit_report``); bench/cmdare_fit.py writes the figures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.optimize import least_squares, nnls

from meshmorph.predict.measurements import measurements
from meshmorph.spec.gpus import gpu

NETWORK_BYTES_PER_S = 10e9 / 8
"""GCE VM NIC bandwidth assumed in the features (10 Gb/s; the coefficients absorb the real one)."""
FEATURES = ("fixed", "flops_over_peak", "tensors_over_peak", "param_bytes_over_network",
            "param_bytes_over_hbm")


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

    def features(self) -> np.ndarray:
        hbm = gpu(self.gpu).hbm_gbps * 1e9
        return np.array([1.0, self.model_flops / self.peak_flops,
                         self.tensors * 1e12 / self.peak_flops,
                         8 * self.params / NETWORK_BYTES_PER_S, 4 * self.params / hbm])


@dataclass(slots=True)
class SpeedModel:
    """Fitted coefficients of the single-worker and cluster formulas."""

    worker: np.ndarray = field(default_factory=lambda: np.zeros(len(FEATURES)))
    """c0..c4 of the single-worker step time (seconds per feature unit)."""
    server: np.ndarray = field(default_factory=lambda: np.array([1e-3, 1.0, 1e-4, 4.0]))
    """a0, a1, a2 of the parameter-server time per update, and the blend exponent p."""

    def step_time_s(self, point: SpeedPoint) -> float:
        return float(point.features() @ self.worker)

    def steps_per_s(self, point: SpeedPoint) -> float:
        a0, a1, a2, power = self.server
        step = self.step_time_s(point)
        server = a0 + a1 * 8 * point.params / NETWORK_BYTES_PER_S + a2 * point.tensors
        load = point.workers * server / point.parameter_servers
        return point.workers / (step**power + load**power) ** (1 / power)


def single_worker_points() -> list[SpeedPoint]:
    return [SpeedPoint(gpu=r["gpu"].lower(), model=r["model"], peak_flops=r["gpu_peak_tflops"] * 1e12,
                       model_flops=r["model_flops"], params=r["n_parameters"],
                       tensors=r["n_tensors"], steps_per_s=1.0 / r["step_time_s"])
            for r in measurements()["single_worker"]]


def cluster_points() -> list[SpeedPoint]:
    models = {(p.gpu, p.model): p for p in single_worker_points()}
    out = []
    for r in measurements()["cluster_scaling"]:
        base = models[(r["gpu"].lower(), r["model"])]
        out.append(SpeedPoint(gpu=base.gpu, model=base.model, peak_flops=base.peak_flops,
                              model_flops=base.model_flops, params=base.params,
                              tensors=base.tensors, workers=r["workers"],
                              parameter_servers=r["parameter_servers"],
                              steps_per_s=r["speed_steps_per_s"]))
    return out


def fit_worker(points: list[SpeedPoint]) -> np.ndarray:
    """Non-negative coefficients minimising the squared relative error of the step time."""
    times = np.array([1.0 / p.steps_per_s for p in points])
    matrix = np.array([p.features() for p in points]) / times[:, None]
    coefficients, _ = nnls(matrix, np.ones(len(points)))
    return coefficients


def fit_server(model: SpeedModel, points: list[SpeedPoint]) -> np.ndarray:
    """Parameter-server coefficients and blend exponent minimising squared log error."""
    # the formula of SpeedModel.steps_per_s over all points at once
    step = np.array([model.step_time_s(p) for p in points])
    workers = np.array([p.workers for p in points], dtype=float)
    servers = np.array([p.parameter_servers for p in points], dtype=float)
    net = np.array([8 * p.params / NETWORK_BYTES_PER_S for p in points])
    tensors = np.array([p.tensors for p in points], dtype=float)
    measured = np.log([p.steps_per_s for p in points])

    def residuals(theta: np.ndarray) -> np.ndarray:
        a0, a1, a2, power = theta
        load = workers * (a0 + a1 * net + a2 * tensors) / servers
        return np.log(workers) - np.log(step**power + load**power) / power - measured

    start = np.array([1e-3, 1.0, 1e-4, 4.0])
    return least_squares(residuals, start, bounds=([0, 0, 0, 1], np.inf)).x


def fit() -> SpeedModel:
    model = SpeedModel(worker=fit_worker(single_worker_points()))
    model.server = fit_server(model, cluster_points())
    return model


def _mape(predicted: list[float], measured: list[float]) -> float:
    return float(np.mean([abs(p - m) / m for p, m in zip(predicted, measured, strict=True)]))


def fit_report() -> dict[str, Any]:
    """In-sample and leave-one-out MAPE of both formulas, with the fitted coefficients."""
    single, cluster = single_worker_points(), cluster_points()
    model = fit()
    loo_single = []
    for i, point in enumerate(single):
        held = SpeedModel(worker=fit_worker(single[:i] + single[i + 1:]))
        loo_single.append(1.0 / held.step_time_s(point))
    loo_cluster = []
    for i, point in enumerate(cluster):
        held = SpeedModel(worker=model.worker)
        held.server = fit_server(held, cluster[:i] + cluster[i + 1:])
        loo_cluster.append(held.steps_per_s(point))
    measured_single = [p.steps_per_s for p in single]
    measured_cluster = [p.steps_per_s for p in cluster]
    loo_all = _mape(loo_single + loo_cluster, measured_single + measured_cluster)
    return {
        "features": list(FEATURES),
        "worker_coefficients": model.worker.tolist(),
        "server_coefficients_a0_a1_a2_p": model.server.tolist(),
        "single_worker": {"points": len(single),
                          "mape_in_sample": _mape([model.steps_per_s(p) for p in single],
                                                  measured_single),
                          "mape_leave_one_out": _mape(loo_single, measured_single)},
        "cluster": {"points": len(cluster),
                    "mape_in_sample": _mape([model.steps_per_s(p) for p in cluster],
                                            measured_cluster),
                    "mape_leave_one_out": _mape(loo_cluster, measured_cluster)},
        "mape_leave_one_out_all": loo_all,
        "predictions": [{"gpu": p.gpu, "model": p.model, "workers": p.workers,
                         "parameter_servers": p.parameter_servers,
                         "measured_steps_per_s": p.steps_per_s, "loo_steps_per_s": q}
                        for p, q in zip(single + cluster, loo_single + loo_cluster, strict=True)],
    }
