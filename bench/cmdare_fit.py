"""CM-DARE's transient-cloud measurements reproduced: training speed and revocations.

Section 1: the physics-first speed regression (meshmorph.predict.speed_model) on CM-DARE's 40
single-worker points (20 CNNs x K80/P100) and 96 cluster points (1-8 workers, 1-2 parameter
servers): in-sample and leave-one-out MAPE (target <= 12%), and a predicted-vs-measured chart.
Section 2: the revocation hazard by VM age (meshmorph.predict.revocation) fitted to the published
revocation counts, against the published CDF and the held-out lifetimes (128 K80 VMs; ICAC 2019
February 2019 VMs): fitted rates, the largest CDF gaps, Kolmogorov-Smirnov distances, and a chart.

Run: ``python bench/cmdare_fit.py``; writes bench/results/cmdare_fit.json, cmdare_fit.png,
revocation_fit.json and revocation_hazard.png.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from meshmorph.predict.revocation import revocation_report
from meshmorph.predict.speed_model import fit_report
from meshmorph.viz.predict_charts import write_hazard_chart

RESULTS = Path(__file__).resolve().parent / "results"


def speed_chart(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    for single, colour in ((True, "#2e7d32"), (False, "#1565c0")):
        points = [p for p in report["predictions"] if (p["workers"] == 1 and p["parameter_servers"] == 1
                                                      and single) or (not single and p["workers"] > 1)]
        ax.scatter([p["measured_steps_per_s"] for p in points], [p["loo_steps_per_s"] for p in points],
                   s=12, color=colour, label="one worker" if single else "2-8 workers")
    ax.plot([0.3, 200], [0.3, 200], color="grey", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured steps/s (CM-DARE)")
    ax.set_ylabel("predicted steps/s (leave-one-out)")
    ax.set_title(f"LOO MAPE {report['mape_leave_one_out_all']:.1%} over "
                 f"{len(report['predictions'])} points")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    RESULTS.mkdir(exist_ok=True)
    started = time.perf_counter()
    speed = fit_report()
    speed["fit_and_loo_time_s"] = time.perf_counter() - started
    (RESULTS / "cmdare_fit.json").write_text(json.dumps(speed, indent=1) + "\n")
    speed_chart(speed, RESULTS / "cmdare_fit.png")
    print(f"speed: single worker LOO MAPE {speed['single_worker']['mape_leave_one_out']:.1%} "
          f"(in-sample {speed['single_worker']['mape_in_sample']:.1%}, "
          f"{speed['single_worker']['points']} points); cluster LOO MAPE "
          f"{speed['cluster']['mape_leave_one_out']:.1%} (in-sample "
          f"{speed['cluster']['mape_in_sample']:.1%}, {speed['cluster']['points']} points); "
          f"all {speed['mape_leave_one_out_all']:.1%} (target <= 12%)")
    revocation = revocation_report()
    (RESULTS / "revocation_fit.json").write_text(json.dumps(revocation, indent=1) + "\n")
    write_hazard_chart(RESULTS / "revocation_hazard.png")
    for gpu, entry in revocation["gpus"].items():
        extra = (f", KS vs 128 lifetimes {entry['ks_k80_128_lifetimes']:.3f}"
                 if "ks_k80_128_lifetimes" in entry else "")
        print(f"revocation {gpu}: revoked by 24 h {entry['revoked_by_24h_model']:.3f} (published "
              f"{entry['revoked_by_24h_published']:.3f}), largest CDF gap "
              f"{entry['max_cdf_gap_published']:.3f}, KS vs ICAC Feb 2019 "
              f"{entry['ks_icac_feb2019']:.3f} ({entry['icac_feb2019_vms']} VMs){extra}")
    print(f"wrote {RESULTS}/cmdare_fit.json, cmdare_fit.png, revocation_fit.json, "
          "revocation_hazard.png")


if __name__ == "__main__":
    main()
