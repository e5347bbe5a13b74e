"""Subcommands of the plan package: ``meshmorph plan`` (``--layerwise`` / ``--uniform`` too)
and ``estimate``. Every error a user can fix is a ValueError (one line, exit code 2)."""

from __future__ import annotations

import argparse
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from meshmorph.cli.args import bounded_int, positive_int
from meshmorph.cli.flags import add_field, add_fields, config_from
from meshmorph.cli.output import finish, unwritable, write_json
from meshmorph.cost.model import CostModel
from meshmorph.cost.profile import Profile
from meshmorph.cost.rank_state import predict_ranks
from meshmorph.cost.segments import as_layerwise
from meshmorph.plan.report import layer_strategy_summary, print_estimate, print_plans
from meshmorph.plan.search import LAYERWISE, SearchResult, search
from meshmorph.plan.space import SearchOptions
from meshmorph.schedule.table import Schedule
from meshmorph.spec.catalog import load_model
from meshmorph.spec.cluster import Cluster, parse_cluster
from meshmorph.spec.model import ModelSpec, Recompute
from meshmorph.spec.plan import Plan, PlanError, load_plan
from meshmorph.tables import report_console

MAX_GLOBAL_BATCH = 2**24
"""Largest --global-batch accepted (sequences per step); beyond it a number is a typo."""
MAX_SEQ_LEN = 2**24
"""Largest --seq-len accepted (tokens per sequence)."""


def _write_charts(plan: Plan, cost, estimate, chart: Path, console) -> None:  # type: ignore[no-untyped-def]
    """The pipeline timeline to ``chart``, the memory chart beside it (``NAME-memory.png``)."""
    from meshmorph.viz.memory_chart import write_memory_chart
    from meshmorph.viz.timeline_chart import write_plan_pipeline_chart

    memory_png = chart.with_name(f"{chart.stem}-memory{chart.suffix or '.png'}")
    try:
        write_plan_pipeline_chart(plan, cost, chart)
        write_memory_chart(estimate, memory_png,
                           title=f"{plan.model}: peak memory per GPU by pipeline stage")
    except OSError as exc:
        raise unwritable(chart, exc, "--chart") from None
    console.print(f"charts: {chart} (pipeline timeline), {memory_png} (memory per stage)")


# --- meshmorph plan --------------------------------------------------------------------------
def _plan(args: argparse.Namespace) -> int:
    if args.max_nodes < 0:
        raise ValueError(f"--max-nodes must be 0 (no limit) or a positive count, got "
                         f"{args.max_nodes}")
    if not math.isfinite(args.tolerance) or args.tolerance < 0:
        raise ValueError(f"--tolerance must be a finite fraction >= 0 (0 = exact), got "
                         f"{args.tolerance}")
    model = load_model(args.model, args.seq_len)
    cluster = parse_cluster(args.cluster)
    layerwise = args.layerwise or args.uniform
    options = config_from(args, SearchOptions, max_nodes=args.max_nodes or None,
                          tp_comm_overlap=(False, True) if args.tp_comm_overlap else (False,),
                          layerwise=layerwise, one_strategy_per_stage=args.uniform,
                          runnable_only=args.layerwise_schedules == "runnable")
    cost = CostModel(model, cluster, profile=Profile.load(args.profile) if args.profile else None)
    result = search(model, cluster, global_batch=args.global_batch, options=options, cost=cost)
    if layerwise:
        return _report_layerwise(args, model, cluster, options, cost, result)
    console = report_console(args.wide)
    params = (f"{model.num_params / 1e9:.2f} B" if model.num_params >= 1e9
              else f"{model.num_params / 1e6:.2f} M")
    console.print(f"[bold]{model.name}[/] ({params} parameters, "
                  f"{model.num_blocks} blocks, seq {model.seq_len}) on {cluster.describe()} "
                  f"({cluster.world_size} GPUs), global batch {args.global_batch}, {args.dtype}")
    print_plans(result.plans, console, model=model,
                title=f"best {len(result.plans)} plans, fastest first")
    console.print(f"searched {result.configurations} configurations, solved "
                  f"{result.configurations_solved}, in {result.search_time_s:.2f} s CPU; "
                  f"proven optimality gap {result.optimality_gap:.2%} "
                  "(0% = the best plan is optimal under the cost model)")
    if args.json:
        write_json(args.json, {
            "search_time_s": result.search_time_s, "cluster": cluster.describe(),
            "configurations": result.configurations,
            "configurations_solved": result.configurations_solved,
            "optimality_gap": result.optimality_gap,
            "uniform_best_tokens_per_s": result.estimates[0].tokens_per_s,  # every plan is uniform
            "plans": [plan.to_dict() for plan in result.plans]})
        console.print(f"plans written to {args.json}")
    if args.chart:
        _write_charts(result.plans[0], cost, result.estimates[0], args.chart, console)
    return 0


def _figure(tokens_per_s: float | None) -> str:
    return "none fits" if tokens_per_s is None else f"{tokens_per_s:,.0f} tokens/s"


def _tokens(result: SearchResult | None, uniform: bool = False) -> float | None:
    """A result's best throughput (with ``uniform``, its best with one strategy per stage)."""
    found = (result.uniform_estimate if uniform else result.estimates[0]) if result else None
    return found.tokens_per_s if found else None


def _report_layerwise(args: argparse.Namespace, model: ModelSpec, cluster: Cluster,
                      options: SearchOptions, cost: CostModel, choice: SearchResult) -> int:
    """``--layerwise`` / ``--uniform``: the returned plan beside the per-layer space's best,
    its best with one strategy per stage and the regular planner's; ``--json``."""
    result, regular = choice.layerwise, choice.regular
    runnable = options.runnable_only
    console = report_console(args.wide)
    console.print(f"[bold]{model.name}[/] (seq {model.seq_len}) on {cluster.describe()} "
                  f"({cluster.world_size} GPUs), global batch {args.global_batch}, "
                  f"{'one strategy per stage' if args.uniform else 'a strategy per layer'}, "
                  f"{'runnable schedules' if runnable else 'every schedule (priced only)'}")
    plan = choice.plans[0]
    print_plans([plan], console, model=model, title=f"best plan (from the {choice.source} search)")
    for line in layer_strategy_summary(plan):
        console.print(f"layer strategies, {line}")
    layerwise, uniform, regular_tokens = _tokens(result), _tokens(result, True), _tokens(regular)
    regular_lw = None  # the regular plan priced layer by layer, where the layerwise engine runs it
    if regular is not None and regular.plans[0].schedule != Schedule.ASYNC \
            and regular.plans[0].cp == 1:
        regular_lw = cost.estimate(as_layerwise(regular.plans[0])).tokens_per_s
    console.print(f"returned the {choice.source} plan, {choice.estimates[0].tokens_per_s:,.0f} "
                  f"tokens/s; layerwise search {_figure(layerwise)}, its best with one strategy "
                  f"per stage {_figure(uniform)}; regular planner {_figure(regular_tokens)}")
    if LAYERWISE in choice.errors:
        console.print(f"layerwise search: {choice.errors[LAYERWISE]}")
    if not choice.runnable:
        console.print("[yellow]this plan cannot be run yet[/]: the layerwise runtime runs "
                      "pipelines without sequence parallelism, untied for pp > 1; plan with "
                      "--layerwise-schedules runnable for one it runs")
    if result is not None:
        console.print(f"layerwise: {result.configurations} configurations, "
                      f"{result.configurations_solved} solved, in {result.search_time_s:.2f} s CPU; "
                      f"proven within {result.optimality_gap:.2%} of the optimum under the "
                      "layerwise cost model")
    if args.json:
        figures = ("configurations", "configurations_solved", "lower_bound_s", "optimality_gap")
        write_json(args.json, {
            "search_time_s": getattr(result, "search_time_s", None),
            "regular_search_time_s": getattr(regular, "search_time_s", None),
            "cluster": cluster.describe(), "layerwise": not args.uniform,
            "layerwise_schedules": "runnable" if runnable else "all",
            "returned": choice.source, "runnable": choice.runnable,
            **{key: getattr(result, key, None) for key in figures},
            "layerwise_best_tokens_per_s": layerwise, "uniform_best_tokens_per_s": uniform,
            "regular_best_tokens_per_s": regular_tokens,
            "regular_best_layerwise_cost_tokens_per_s": regular_lw, "plans": [plan.to_dict()]})
        console.print(f"plans written to {args.json}")
    return 0


# --- meshmorph estimate ----------------------------------------------------------------------
def build_plan(args: argparse.Namespace, model) -> Plan:  # type: ignore[no-untyped-def]
    """The Plan the ``estimate`` flags describe (or the ``--plan`` file), stages filled in."""
    recompute = Recompute(args.recompute)
    if args.plan is not None:
        given = [f"--{n}" for n in ("tp", "pp", "dp") if getattr(args, n) is not None]
        if given:
            raise PlanError(f"give either --plan or {'/'.join(given)}, not both")
        plan = replace(load_plan(args.plan), seq_len=model.seq_len)
        return plan if plan.stages else plan.with_even_stages(model, recompute)
    missing = [f"--{n}" for n in ("tp", "pp", "dp") if getattr(args, n) is None]
    if missing:
        raise PlanError(f"estimate needs {', '.join(missing)} (or --plan FILE)")
    tp, pp, dp, micro, vpp = args.tp, args.pp, args.dp, args.micro_batch, args.vpp
    schedule = Schedule(args.schedule) if args.schedule else (
        Schedule.INTERLEAVED if vpp > 1 else Schedule.ONE_F_ONE_B)
    if schedule.v_shape:  # the table's chunks per rank, whatever --vpp says
        vpp = schedule.info.vpp_for(vpp)
    # default batch: one micro-batch per pipeline stage on every data-parallel rank
    global_batch = args.global_batch or dp * micro * pp
    if global_batch % (dp * micro):
        raise PlanError(
            f"global batch {global_batch} is not divisible by dp {dp} x micro-batch {micro} = "
            f"{dp * micro}; choose a batch that is a multiple of {dp * micro}"
        )
    plan = Plan(model=args.model, seq_len=model.seq_len, global_batch=global_batch, tp=tp, pp=pp,
                dp=dp, micro_batch=micro, num_microbatches=global_batch // (dp * micro),
                schedule=schedule, vpp=vpp, **{f: getattr(args, f) for f in _PLAN_FLAGS})
    return plan.with_even_stages(model, recompute)


def _estimate(args: argparse.Namespace) -> int:
    cluster = parse_cluster(args.cluster)
    if args.plan is not None:
        stored = load_plan(args.plan)
        model = load_model(args.model or stored.model, args.seq_len or stored.seq_len)
    elif args.model is None:
        raise PlanError("estimate needs --model (or --plan FILE)")
    else:
        model = load_model(args.model, args.seq_len)
    plan = build_plan(args, model)
    plan.check_against(model, cluster.world_size)
    cost = CostModel(model, cluster, profile=Profile.load(args.profile) if args.profile else None)
    estimate = cost.estimate(plan)  # each stage's segments, layer strategies or not
    console = report_console(args.wide)
    console.print(f"[bold]{model.name}[/] on {cluster.describe()} ({cluster.world_size} GPUs)")
    print_estimate(plan, estimate, console, model=model)
    if args.json:
        # per-rank state and traffic: what the run's "state" line measures against
        predicted = {**estimate.to_dict(), "ranks": predict_ranks(model, plan)}
        write_json(args.json, replace(plan, predicted=predicted).to_dict())
        console.print(f"estimate written to {args.json}")
    if args.chart:
        _write_charts(plan, cost, estimate, args.chart, console)
    return 0 if estimate.fits else 1


# --- registration ----------------------------------------------------------------------------
_PLAN_FLAGS = ("cp", "zero", "sequence_parallel", "tp_comm_overlap", "overlap_grad_reduce",
               "fsdp_prefetch", "overlap_param_gather", "dtype", "fp8_scaling", "compile")
"""The Plan fields ``estimate`` takes a flag for, under the field's own name, help and default."""


def register(subparsers: argparse._SubParsersAction) -> None:
    plan = subparsers.add_parser(
        "plan", help="search the fastest parallel layouts of a model on a cluster",
        description="Search tp/pp/dp, ZeRO, sequence parallel, micro-batch, schedule, stage "
                    "boundaries and per-layer recompute; print the best plans.")
    _common_flags(plan, True, "catalog name, config.json path or package.module:function",
                  "sequences per optimizer step")
    add_fields(plan, SearchOptions, "max_micro_batch", top_k="--top")
    add_field(plan, SearchOptions, "tolerance", type=float)  # 0 (exact) is allowed
    add_field(plan, SearchOptions, "max_nodes", type=int,
              help="branch-and-bound nodes per configuration before the rest is left with its "
                   "bound (the proven gap is printed); 0 = no limit")
    add_field(plan, SearchOptions, "cp_max", "--max-cp", type=positive_int,
              help="largest context-parallel degree (ring attention) tried for sequences of "
                   "16K tokens and more (default: what the GPUs allow; 1 = none, the plans "
                   "meshmorph run accepts)")
    plan.add_argument("--layerwise", action="store_true",
                      help="let each layer of a stage choose its own tp/dp/ZeRO (exact Pareto "
                           "program); returns the regular planner's plan where it is faster")
    plan.add_argument("--uniform", action="store_true",
                      help="the layerwise search restricted to one strategy per stage")
    plan.add_argument("--layerwise-schedules", choices=("runnable", "all"), default="runnable",
                      help="with --layerwise: 'runnable' (default) searches only plans meshmorph "
                           "runs (no sequence parallel, pp 1 for tied embeddings); 'all' also "
                           "prices sequence-parallel layerwise plans and pipelines of tied "
                           "embeddings, which the runtime does not run yet")
    plan.add_argument("--tp-comm-overlap", action="store_true",
                      help="also weigh tensor-parallel communication overlapped with the GEMMs "
                           "(Megatron-LM's --tp-comm-overlap, with sequence parallelism) against "
                           "its buffers; meshmorph run runs such plans on CUDA as torch's "
                           "async TP (with compile) and refuses them on CPU")
    add_fields(plan, SearchOptions, "allow_async", "weight_prediction")
    _output_flags(plan, _plan, json="write the plans to this JSON file",
                  chart="write the best plan's pipeline timeline to this PNG (and its memory per "
                        "stage to NAME-memory.png)")

    est = subparsers.add_parser(
        "estimate", help="predict step time and memory of one layout",
        description="Predict one plan's step time (with its terms), throughput, MFU and memory "
                    "per pipeline stage. Exit code 1 when it does not fit the devices' memory.")
    _common_flags(est, False, "catalog name, config.json or factory (default with --plan: the "
                  "plan's model)", "sequences per step (default dp x micro-batch x pp)")
    est.add_argument("--plan", type=Path, default=None,
                     help="plan JSON (a plan, or the output of 'meshmorph plan --json')")
    for name in ("tp", "pp", "dp"):
        add_field(est, Plan, name, default=None, type=positive_int)
    add_fields(est, Plan, "micro_batch", "vpp", *_PLAN_FLAGS[:4],
               overlap_grad_reduce="--no-overlap-grad-reduce", fsdp_prefetch="--no-fsdp-prefetch",
               overlap_param_gather="--no-overlap-param-gather")
    add_field(est, Plan, "schedule", default=None,
              help="pipeline schedule (default 1f1b, interleaved when --vpp > 1)")
    est.add_argument("--recompute", choices=[str(r) for r in Recompute], default="none",
                     help="activation recompute of every block")
    _output_flags(est, _estimate, json="write the plan and its prediction to this JSON file",
                  chart="write the pipeline timeline to this PNG (and NAME-memory.png)")


def _common_flags(parser: argparse.ArgumentParser, required: bool, model_help: str,
                  global_batch: str) -> None:
    """--model, --cluster, --global-batch, --seq-len and the numerics (plan and estimate; only
    ``plan`` requires a model and a batch)."""
    parser.add_argument("--model", required=required, default=None, help=model_help)
    parser.add_argument("--cluster", required=True, help="GPU:NODESxPER_NODE (h100:4x8) or a .toml")
    parser.add_argument("--global-batch", required=required, default=None, help=global_batch,
                        type=bounded_int(MAX_GLOBAL_BATCH, "sequences"))
    parser.add_argument("--seq-len", type=bounded_int(MAX_SEQ_LEN, "tokens"), default=None,
                        help="sequence length (default: the model's own)")
    add_fields(parser, Plan, "dtype", "fp8_scaling", "compile")


def _output_flags(parser: argparse.ArgumentParser, func: Any, *, json: str, chart: str) -> None:
    """--profile, --json, --chart and --wide (plan and estimate)."""
    parser.add_argument("--profile", type=Path, default=None,
                        help="a Profile JSON (meshmorph profile) replacing catalog figures")
    finish(parser, func, json=json, chart=chart)
