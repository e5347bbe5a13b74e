"""The cost model against every published run it can be checked on, with its error told honestly.

Published runs (package data, copied from the project's reference folder): Narayanan et al. 2021
Table 1 (GPT, 1.7B-1T, A100-80GB) and the Megatron-LM README tables of 2020-09 (GPT 1.2B-8.3B on
one DGX-2 V100 node and DGX A100 nodes, model- and data-parallel scaling) and 2021-01 (the same
sizes as Table 1 with earlier software). Each run is estimated as Megatron-LM ran it: fp16, fp16
gradient all-reduce, attention that keeps its s x s scores, dropout, full recompute, micro-batch 1
with gradient accumulation where the source states no micro-batch and the run accumulates (2021
tables), one micro-batch of the whole per-rank batch where the 2020 tables ran without
accumulation, interleaved 1F1B with the smallest v in
2..6 that splits the blocks evenly under pipeline parallelism (the sources do not state v).
The figure compared is hardware TFLOP/s per GPU as Narayanan Eq. 3 counts it (recompute included).

``fit`` chooses the named coefficients by least squares on log(predicted / published);
``leave_one_out`` refits without each run and predicts it, the honest error of the fitted model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cache
from importlib.resources import files
from typing import Any

from meshmorph.cost.coefficients import CostCoefficients
from meshmorph.cost.model import CostModel
from meshmorph.schedule.table import Schedule
from meshmorph.spec.cluster import Cluster, parse_cluster
from meshmorph.spec.model import ModelSpec, Recompute
from meshmorph.spec.plan import Plan
from meshmorph.spec.transformer import TransformerShape, build_transformer

SOURCES = ("narayanan2021_table1.json", "megatron_readme_tables.json")


@dataclass(frozen=True, slots=True)
class PublishedRun:
    """One published training run and how it was laid out."""

    id: str
    """The entry's id in its source file."""
    source: str
    """Source file under meshmorph/data."""
    model: ModelSpec
    """The model as meshmorph describes it."""
    cluster: Cluster
    """The GPUs it ran on (catalog GPU, nodes x GPUs per node)."""
    plan: Plan
    """The layout it ran with (see the module docstring for what is inferred)."""
    published_tflops: float
    """Achieved hardware TFLOP/s per GPU as published."""


def _cluster_text(entry: dict[str, Any]) -> str:
    hw = entry["hardware"]
    total = hw["total_gpus"]
    if "V100" in hw["gpu"]:
        gpu, per_node = "v100-32g", 16  # DGX-2: 16 V100 32GB on NVSwitch
    elif "80GB" in hw["gpu"] or "Table 1" in str(entry["source"]):
        gpu, per_node = "a100-80g", 8
    elif entry["source"].get("date", "") >= "2021":
        gpu, per_node = "a100-80g", 8  # Selene, 2021: A100-80GB (memory not stated in the README)
    else:
        gpu, per_node = "a100-40g", 8  # DGX A100 of 2020: 40GB
    nodes, per = (1, total) if total <= per_node else (total // per_node, per_node)
    return f"{gpu}:{nodes}x{per}"


def _run(entry: dict[str, Any], source: str) -> PublishedRun:
    shape, par = entry["model"], entry["parallel"]
    seq = shape["seq_length"]
    model = build_transformer(TransformerShape(
        name=entry["id"], arch="gpt", num_layers=shape["num_layers"],
        hidden_size=shape["hidden_size"], num_heads=shape["num_attention_heads"],
        ffn_hidden_size=shape["ffn_hidden_size"], vocab_size=shape["vocab_size"], seq_len=seq,
        tied_embeddings=True,
        # Megatron-LM 2021 kept the s x s attention scores (no flash kernel) and trained with
        # hidden and attention dropout 0.1: its activations, not the ones meshmorph's runtime holds
        flash_attention=False, dropout=True))
    tp, pp, dp, batch = (par["tensor_parallel"], par["pipeline_parallel"], par["data_parallel"],
                         par["global_batch"])
    per_rank = batch // dp
    micro = par.get("micro_batch") or (per_rank if entry["source"].get("date", "") < "2021"
                                       and "paper" not in entry["source"] else 1)
    m = per_rank // micro
    schedule, vpp = Schedule.ONE_F_ONE_B, 1
    if pp > 1:
        for v in range(2, 7):
            if model.num_blocks % (pp * v) == 0 and m % pp == 0:
                schedule, vpp = Schedule.INTERLEAVED, v
                break
    plan = Plan(model=entry["id"], seq_len=seq, global_batch=batch, tp=tp, pp=pp, dp=dp,
                micro_batch=micro, num_microbatches=m, schedule=schedule, vpp=vpp, dtype="fp16",
                reduce_dtype="fp16",
                # Megatron-LM 2020-21 had neither --overlap-grad-reduce nor --tp-comm-overlap:
                # gradients were all-reduced after the backward (Narayanan et al. 2021, sec. 3)
                overlap_grad_reduce=False, tp_comm_overlap=False)
    return PublishedRun(id=entry["id"], source=source, model=model,
                        cluster=parse_cluster(_cluster_text(entry)),
                        plan=plan.with_even_stages(model, Recompute.FULL),
                        published_tflops=float(entry["published"]["achieved_tflops_per_gpu"]))


@cache
def published_runs() -> tuple[PublishedRun, ...]:
    """Every published run of the calibration sources, in file order."""
    runs = []
    for source in SOURCES:
        entries = json.loads(files("meshmorph").joinpath(f"data/{source}").read_text())["entries"]
        runs.extend(_run(entry, source) for entry in entries)
    return tuple(runs)


def predicted_tflops(run: PublishedRun, coef: CostCoefficients) -> float:
    """Hardware TFLOP/s per GPU the cost model predicts for the run's layout."""
    return CostModel(run.model, run.cluster, coef).estimate(run.plan).tflops_per_gpu


@dataclass(frozen=True, slots=True)
class FitSpace:
    """Which coefficients a fit chooses, and within what physical range."""

    names: tuple[str, ...]
    """CostCoefficients fields the fit chooses."""
    lower: tuple[float, ...]
    """Smallest value each may take."""
    upper: tuple[float, ...]
    """Largest value each may take."""


def fit(runs: Sequence[PublishedRun], space: FitSpace, start: CostCoefficients,
        predict: Callable[[PublishedRun, CostCoefficients], float] = predicted_tflops,
        ) -> CostCoefficients:
    """The coefficients in ``space`` minimising the squared log error over ``runs``."""
    from scipy.optimize import least_squares

    def residuals(x: Sequence[float]) -> list[float]:
        coef = replace(start, **dict(zip(space.names, (float(v) for v in x), strict=True)))
        return [math.log(predict(run, coef) / run.published_tflops) for run in runs]

    x0 = [min(max(getattr(start, n), lo), hi)
          for n, lo, hi in zip(space.names, space.lower, space.upper, strict=True)]
    result = least_squares(residuals, x0, bounds=(space.lower, space.upper), x_scale="jac",
                           diff_step=1e-3, xtol=1e-4, ftol=1e-5, max_nfev=200)
    return replace(start, **dict(zip(space.names, (float(v) for v in result.x), strict=True)))


def errors(runs: Sequence[PublishedRun], coef: CostCoefficients,
           predict: Callable[[PublishedRun, CostCoefficients], float] = predicted_tflops,
           ) -> list[float]:
    """predicted / published - 1 for each run."""
    return [predict(run, coef) / run.published_tflops - 1 for run in runs]


def leave_one_out(runs: Sequence[PublishedRun], space: FitSpace, start: CostCoefficients,
                  predict: Callable[[PublishedRun, CostCoefficients], float] = predicted_tflops,
                  ) -> list[tuple[float, CostCoefficients]]:
    """For each run: its error when the coefficients are fitted on all the other runs."""
    out = []
    for index, run in enumerate(runs):
        rest = [r for i, r in enumerate(runs) if i != index]
        coef = fit(rest, space, start, predict)
        out.append((predict(run, coef) / run.published_tflops - 1, coef))
    return out


FIT_SPACE = FitSpace(
    names=("matmul_efficiency", "elementwise_passes", "link_efficiency"),
    lower=(0.3, 0.0, 0.3),
    upper=(1.0, 12.0, 1.0),
)
"""The coefficients calibration chooses, each within its physical range: the GEMM ceiling (the
share of dense peak a large, well-tiled GEMM reaches), HBM passes of the memory-bound kernels
over the saved activations, and the achieved share of nominal link bandwidth."""
