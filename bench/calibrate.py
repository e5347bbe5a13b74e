"""The cost model's error against every published run, in sample and leave-one-out.

For each run of meshmorph.cost.calibration.published_runs (Narayanan et al. 2021 Table 1, the
Megatron-LM README tables of 2020-09 and 2021-01, torchtitan's published runs): the error of the shipped default coefficients,
of coefficients fitted on all runs (in sample), and of coefficients fitted on all other runs
(leave-one-out: the error to expect on a run the model has not seen). Fits choose FIT_SPACE's
coefficients by least squares on log(predicted / published).

Run: ``python bench/calibrate.py``; writes bench/results/latest/calibration.json (``--out PATH``
to choose, ``--update`` to rewrite the committed bench/results/calibration.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import asdict

from meshmorph.cost.calibration import (
    FIT_SPACE,
    coefficient,
    errors,
    fit,
    leave_one_out,
    published_oom_runs,
    published_runs,
)
from meshmorph.cost.coefficients import CostCoefficients
from meshmorph.cost.model import CostModel
from results_path import Outputs, shown

OUTPUTS = Outputs("bench/results/calibration.json")


def summary(errs: list[float]) -> dict[str, float]:
    return {"mape": statistics.fmean(abs(e) for e in errs), "max_abs": max(abs(e) for e in errs),
            "mean_signed": statistics.fmean(errs)}


def oom_rows(coef: CostCoefficients) -> list[dict[str, object]]:
    """The published runs that ran out of memory, with the peak the fitted model predicts."""
    out = []
    for run in published_oom_runs():
        est = CostModel(run.model, run.cluster, coef).estimate(run.plan)
        out.append({"id": run.id, "source": run.source, "predicted_fits": est.fits,
                    "predicted_peak_gib": max(est.peak_memory_gib),
                    "memory_gib": run.cluster.groups[0].gpu.memory_gib})
        print(f"{run.id:44s} out of memory as published; predicted peak "
              f"{max(est.peak_memory_gib):.1f} GiB, fits: {est.fits}")
    return out


def by_source(runs, errs: list[float]) -> dict[str, dict[str, float]]:
    return {source: summary([e for r, e in zip(runs, errs, strict=True) if r.source == source])
            for source in dict.fromkeys(r.source for r in runs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    OUTPUTS.add_args(parser)
    args = parser.parse_args()
    out = OUTPUTS.path(args)
    started = time.perf_counter()
    runs = published_runs()
    default = CostCoefficients()
    default_errs = errors(runs, default)
    fitted = fit(runs, FIT_SPACE, default)
    fitted_errs = errors(runs, fitted)
    loo = leave_one_out(runs, FIT_SPACE, fitted)
    loo_errs = [e for e, _ in loo]
    rows = []
    print(f"{'run':44s} {'layout':34s} {'pub':>6s} {'default':>8s} {'fitted':>8s} {'LOO':>8s}")
    for run, d, f, (o, coef) in zip(runs, default_errs, fitted_errs, loo, strict=True):
        p = run.plan
        layout = (f"{run.cluster.name} t{p.tp} p{p.pp} d{p.dp} mb{p.micro_batch}x"
                  f"{p.num_microbatches} {p.schedule.value}{'' if p.vpp == 1 else p.vpp}")
        rows.append({"id": run.id, "source": run.source, "layout": layout,
                     "published_tflops": run.published_tflops,
                     "published_tokens_per_s_per_gpu": run.published_tokens_per_s_per_gpu,
                     "eager": run.eager,
                     "default_error": d, "fitted_error": f, "leave_one_out_error": o,
                     "leave_one_out_coefficients": {n: coefficient(coef, n) for n in FIT_SPACE.names}})
        print(f"{run.id:44s} {layout:34s} {run.published_tflops:6.1f} {d:+8.1%} {f:+8.1%} {o:+8.1%}")
    result = {
        "machine": platform.platform(), "runs": len(runs), "fit_space": asdict(FIT_SPACE),
        "default_coefficients": {n: coefficient(default, n) for n in FIT_SPACE.names},
        "fitted_coefficients": {n: coefficient(fitted, n) for n in FIT_SPACE.names},
        "default": summary(default_errs), "in_sample": summary(fitted_errs),
        "leave_one_out": summary(loo_errs),
        "in_sample_by_source": by_source(runs, fitted_errs),
        "leave_one_out_by_source": by_source(runs, loo_errs),
        "rows": rows, "out_of_memory_rows": oom_rows(fitted),
        "seconds": time.perf_counter() - started,
    }
    for key in ("default", "in_sample", "leave_one_out"):
        s = result[key]
        print(f"{key:14s} MAPE {s['mape']:.1%}  max {s['max_abs']:.1%}  mean {s['mean_signed']:+.1%}")
    print("fitted:", result["fitted_coefficients"])
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {shown(out)} in {result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
