"""The cost model against every published run it can be checked on, with its error told honestly
(docs/cost-model.md, "Calibration, in sample and leave-one-out", has the sources, the
inferences and the errors).

Published runs (package data): Narayanan et al. 2021 Table 1 and the Megatron-LM README tables of
2020-09 and 2021-01, each estimated as Megatron-LM ran it (``_run``: fp16 with fp16 gradient
all-reduce, attention that keeps its s x s scores, dropout, full recompute, micro-batch 1 where
the source states none and the run accumulates, interleaved 1F1B with the smallest v in 2..6
that splits the blocks evenly); and torchtitan's runs (``torchtitan_runs.json``: FSDP2, TP and
async TP on A100s and on 500 W H100s described in ``data/h100_96g_hbm2e_500w.toml``), estimated
as torchtitan ran them (``_torchtitan_run``). The figure compared is hardware TFLOP/s per GPU as
Narayanan Eq. 3 counts it; torchtitan publishes tokens per second, turned into the step's
hardware FLOPs as meshmorph counts them over the published step time. Out-of-memory rows are kept
apart (``published_oom_runs``): they must be predicted not to fit.

``fit`` chooses the named coefficients by least squares on log(predicted / published);
``leave_one_out`` refits without each run and predicts it, the honest error of the fitted model.
"""

from __future__ import annotations

import json
import math
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cache
from importlib.resources import files
from typing import Any

from meshmorph.cost.coefficients import CostCoefficients
from meshmorph.cost.model import CostModel
from meshmorph.schedule.table import Schedule
from meshmorph.spec.cluster import Cluster, NodeGroup, parse_cluster
from meshmorph.spec.gpus import GPUSpec, gpu, gpus_from_toml, link
from meshmorph.spec.model import ModelSpec, Recompute
from meshmorph.spec.plan import Plan, StagePlan, ZeroStage
from meshmorph.spec.transformer import TransformerShape, build_transformer

SOURCES = ("narayanan2021_table1.json", "megatron_readme_tables.json", "torchtitan_runs.json")
H100_500W_TOML = "h100_96g_hbm2e_500w.toml"
"""The GPUs of torchtitan's H100 runs, described in TOML beside the catalog (not the catalog's
H100 SXM5 80GB bent to them)."""


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
    """Achieved hardware TFLOP/s per GPU as published (torchtitan: the step's hardware FLOPs as
    meshmorph counts them over the published step time)."""
    published_tokens_per_s_per_gpu: float | None = None
    """Tokens per second per GPU as published (torchtitan), None where the source gives TFLOP/s."""

    @property
    def eager(self) -> bool:
        """The run's memory-bound ops ran unfused, one kernel each (torchtitan without
        torch.compile): its plan says ``compile`` false, priced with
        ``eager_elementwise_passes``."""
        return not self.plan.compile


def _cluster_text(entry: dict[str, Any]) -> str:
    hw = entry["hardware"]
    total = hw["total_gpus"]
    if "V100" in hw["gpu"]:
        gpu, per_node = "v100-32g", 16  # DGX-2: 16 V100 32GB on NVSwitch
    elif "80GB" in hw["gpu"] or "Table 1" in str(entry["source"]) \
            or entry["source"].get("date", "") >= "2021":  # Selene, 2021: memory not stated
        gpu, per_node = "a100-80g", 8
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
        flash_attention=False, dropout=True, runtime=False))
    tp, pp, dp, batch = (par["tensor_parallel"], par["pipeline_parallel"], par["data_parallel"],
                         par["global_batch"])
    per_rank = batch // dp
    micro = par.get("micro_batch") or (per_rank if entry["source"].get("date", "") < "2021"
                                       and "paper" not in entry["source"] else 1)
    m = per_rank // micro
    vpp = next((v for v in range(2, 7) if model.num_blocks % (pp * v) == 0 and m % pp == 0), 1) \
        if pp > 1 else 1
    schedule = Schedule.INTERLEAVED if vpp > 1 else Schedule.ONE_F_ONE_B
    plan = Plan(model=entry["id"], seq_len=seq, global_batch=batch, tp=tp, pp=pp, dp=dp,
                micro_batch=micro, num_microbatches=m, schedule=schedule, vpp=vpp, dtype="fp16",
                reduce_dtype="fp16",
                # Megatron-LM 2020-21 had neither --overlap-grad-reduce nor --tp-comm-overlap:
                # gradients were all-reduced after the backward (Narayanan et al. 2021, sec. 3);
                # its fused kernels (LayerNorm, bias-GeLU, masked softmax) price as compiled ones
                overlap_grad_reduce=False, tp_comm_overlap=False, compile=True)
    return PublishedRun(id=entry["id"], source=source, model=model,
                        cluster=parse_cluster(_cluster_text(entry)),
                        plan=plan.with_even_stages(model, Recompute.FULL),
                        published_tflops=float(entry["published"]["achieved_tflops_per_gpu"]))


@cache
def h100_500w() -> GPUSpec:
    """The H100 96GB HBM2e at 500 W of torchtitan's runs, read from its TOML."""
    data = tomllib.loads(files("meshmorph").joinpath(f"data/{H100_500W_TOML}").read_text())
    gpus, _ = gpus_from_toml(data, H100_500W_TOML)
    return gpus["h100-96g-hbm2e-500w"]


def _torchtitan_cluster(entry: dict[str, Any]) -> Cluster:
    hw = entry["hardware"]
    total, per_node = hw["total_gpus"], hw["gpus_per_node"] or 8
    if "A100" in hw["gpu"]:
        # node size and network not stated: HGX A100 nodes of 8. The 70B rows at local batch 1
        # and 2 run at the same tokens/s, so the step is compute-bound: the network moves a 70B
        # step's FSDP traffic (560 GB per GPU) within the batch-1 step (11.5 s), 390 Gb/s per
        # GPU at least; described as a 400 Gb/s NIC per GPU (ib-ndr)
        spec, inter = gpu("a100-80g"), link("ib-ndr")
    else:
        spec = h100_500w()
        inter = link(spec.inter_node_link)  # "400 Gb/s per GPU" backend RDMA
    nodes, per = (1, total) if total <= per_node else (total // per_node, per_node)
    group = NodeGroup(gpu=spec, num_nodes=nodes, gpus_per_node=per,
                      intra_link=link(spec.intra_node_link))
    return Cluster(groups=(group,), inter_link=inter, name=f"{spec.name}:{nodes}x{per}")


def _recompute(model: ModelSpec, plan: Plan, checkpoint: str) -> Plan:
    """The plan with torchtitan's activation checkpointing: ``full``, ``none``, ``selective
    op`` (per-op, the model's SELECTIVE) or ``selective layer`` (every second block whole, as
    torchtitan's default ``selective_ac_option = "2"`` wraps blocks 2, 4, ...)."""
    if checkpoint.startswith("full"):
        return plan.with_even_stages(model, Recompute.FULL)
    if checkpoint == "none":
        return plan.with_even_stages(model, Recompute.NONE)
    if "layer" not in checkpoint:
        return plan.with_even_stages(model, Recompute.SELECTIVE)
    plan = plan.with_even_stages(model, Recompute.NONE)
    modes = tuple(Recompute.FULL if 1 <= i <= model.num_blocks and i % 2 == 0 else Recompute.NONE
                  for i in range(model.num_layers))
    return replace(plan, stages=(StagePlan(start=0, stop=model.num_layers, recompute=modes),))


def _torchtitan_run(entry: dict[str, Any], source: str) -> PublishedRun | None:
    """A torchtitan entry as it ran (see the module docstring); None for a run that did not
    (out of memory) or a layout meshmorph does not price (pipeline or context parallel, float8)."""
    shape, par, hw, pub = entry["model"], entry["parallel"], entry["hardware"], entry["published"]
    if par["pipeline_parallel"] != 1 or par["context_parallel"] != 1 or par.get("float8_recipe"):
        return None
    seq = shape["seq_length"] or shape["seq_length_inferred"]["value"]
    model = build_transformer(TransformerShape(
        name=entry["id"], arch="llama", num_layers=shape["num_layers"],
        hidden_size=shape["hidden_size"], num_heads=shape["num_attention_heads"],
        num_kv_heads=shape["num_kv_heads"], ffn_hidden_size=shape["ffn_hidden_size"],
        vocab_size=shape["vocab_size"], seq_len=seq, tied_embeddings=False,
        flash_attention=True, dropout=False, selective="op", runtime=False))
    tp, total, local = par["tensor_parallel"], hw["total_gpus"], par["local_batch"]
    dp = total // tp
    plan = Plan(model=entry["id"], seq_len=seq, global_batch=dp * local, tp=tp, dp=dp,
                zero=ZeroStage.PARAMETERS, micro_batch=local, num_microbatches=1,
                sequence_parallel=tp > 1, tp_comm_overlap=bool(par["async_tp"]),
                compile=bool(par["compile"]))
    plan = _recompute(model, plan, par["activation_checkpoint"])
    run = PublishedRun(id=entry["id"], source=source, model=model,
                       cluster=_torchtitan_cluster(entry), plan=plan, published_tflops=0.0)
    tokens = pub["tokens_per_s_per_gpu"]
    if tokens is None:
        return run
    # the step's hardware FLOPs as meshmorph counts them (no coefficient changes them) over the
    # published step time: global tokens / (tokens per s per GPU x GPUs)
    estimate = CostModel(model, run.cluster).estimate(plan)
    step_s = plan.global_batch * seq / (tokens * total)
    return replace(run, published_tflops=estimate.tflops_per_gpu * estimate.step_time_s / step_s,
                   published_tokens_per_s_per_gpu=float(tokens))


@cache
def _all_runs() -> tuple[PublishedRun, ...]:
    runs: list[PublishedRun] = []
    for source in SOURCES:
        entries = json.loads(files("meshmorph").joinpath(f"data/{source}").read_text())["entries"]
        for entry in entries:
            run = _torchtitan_run(entry, source) if source == "torchtitan_runs.json" \
                else _run(entry, source)
            if run is not None:
                runs.append(run)
    return tuple(runs)


def published_runs() -> tuple[PublishedRun, ...]:
    """Every published run of the calibration sources that ran and reports its throughput, in
    file order."""
    return tuple(run for run in _all_runs() if run.published_tflops > 0)


def published_oom_runs() -> tuple[PublishedRun, ...]:
    """The published runs that ran out of memory (torchtitan's OOM rows): no throughput."""
    return tuple(run for run in _all_runs() if run.published_tflops <= 0)


def predicted_tflops(run: PublishedRun, coef: CostCoefficients) -> float:
    """Hardware TFLOP/s per GPU the cost model predicts for the run's layout."""
    return CostModel(run.model, run.cluster, coef).estimate(run.plan).tflops_per_gpu


def coefficient(coef: CostCoefficients, name: str) -> float:
    """A fitted coefficient by name: a CostCoefficients field, or ``matmul_efficiency:GPU`` for
    one GPU's own GEMM ceiling (``gpu_matmul_efficiency``; the shared one where it has none)."""
    if ":" in name:
        return dict(coef.gpu_matmul_efficiency).get(name.split(":", 1)[1], coef.matmul_efficiency)
    return float(getattr(coef, name))


def with_coefficients(coef: CostCoefficients, names: Sequence[str],
                      values: Sequence[float]) -> CostCoefficients:
    """``coef`` with the named coefficients (as ``coefficient`` names them) set."""
    fields, per_gpu = {}, dict(coef.gpu_matmul_efficiency)
    for name, value in zip(names, values, strict=True):
        if ":" in name:
            per_gpu[name.split(":", 1)[1]] = float(value)
        else:
            fields[name] = float(value)
    return replace(coef, **fields, gpu_matmul_efficiency=tuple(sorted(per_gpu.items())))


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
        coef = with_coefficients(start, space.names, x)
        return [math.log(predict(run, coef) / run.published_tflops) for run in runs]

    x0 = [min(max(coefficient(start, n), lo), hi)
          for n, lo, hi in zip(space.names, space.lower, space.upper, strict=True)]
    result = least_squares(residuals, x0, bounds=(space.lower, space.upper), x_scale="jac",
                           diff_step=1e-3, xtol=1e-4, ftol=1e-5, max_nfev=200)
    return with_coefficients(start, space.names, result.x)


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
        coef = fit([*runs[:index], *runs[index + 1:]], space, start, predict)
        out.append((errors([run], coef, predict)[0], coef))
    return out


FIT_SPACE = FitSpace(
    names=("matmul_efficiency", "elementwise_passes", "link_efficiency",
           "eager_elementwise_passes", "matmul_efficiency:h100-96g-hbm2e-500w"),
    lower=(0.3, 0.0, 0.3, 6.0, 0.3),
    upper=(1.0, 12.0, 1.0, 24.0, 1.0),
)
"""The coefficients calibration chooses, each within its physical range: the GEMM ceiling (the
share of dense peak a large, well-tiled GEMM reaches), HBM passes of the memory-bound kernels
over the saved activations, fused (Megatron-LM, torch.compile) and unfused (eager PyTorch: at
least half again the fused count), the achieved share of nominal link bandwidth, and the GEMM
ceiling of the 500 W H100 of torchtitan's runs (its power limit holds the clock below the one
its nominal peak assumes)."""
