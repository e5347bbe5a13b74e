"""Subcommands of the plan package: ``meshmorph plan`` (``--layerwise`` / ``--uniform`` too)
and ``estimate``.

Every error a user can fix (unknown model or GPU, a bad cluster string, degrees that do not match
the cluster, a batch that does not divide, no plan that fits) is a ValueError, which the console
script prints as one line with exit code 2.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace
from pathlib import Path

from meshmorph.cli.args import bounded_int, positive_int
from meshmorph.cli.output import add_wide, check_writable, unwritable, write_json
from meshmorph.cost.model import CostModel
from meshmorph.cost.profile import Profile
from meshmorph.cost.rank_state import predict_ranks
from meshmorph.cost.segments import as_layerwise
from meshmorph.plan.report import (
    layer_strategy_summary,
    print_estimate,
    print_plans,
)
from meshmorph.plan.search import LAYERWISE, SearchResult, search
from meshmorph.plan.space import SearchOptions
from meshmorph.schedule.table import Schedule
from meshmorph.spec.catalog import load_model
from meshmorph.spec.cluster import Cluster, parse_cluster
from meshmorph.spec.model import ModelSpec, Recompute
from meshmorph.spec.plan import WEIGHT_PREDICTIONS, Fp8Scaling, Plan, PlanError
from meshmorph.spec.plan_file import load_plan
from meshmorph.tables import report_console

DTYPES = ("bf16", "fp16", "fp32", "fp8")
MAX_GLOBAL_BATCH = 2**24
"""Largest --global-batch accepted (sequences per step); beyond it a number is a typo."""
MAX_SEQ_LEN = 2**24
"""Largest --seq-len accepted (tokens per sequence)."""


def _chart_paths(chart: Path) -> tuple[Path, Path]:
    """The pipeline timeline goes to ``chart``, the memory chart beside it (``NAME-memory.png``)."""
    return chart, chart.with_name(f"{chart.stem}-memory{chart.suffix or '.png'}")


def _write_charts(plan: Plan, cost, estimate, chart: Path, console) -> None:  # type: ignore[no-untyped-def]
    from meshmorph.viz.memory_chart import write_memory_chart
    from meshmorph.viz.pipeline_chart import write_plan_pipeline_chart

    timeline_png, memory_png = _chart_paths(chart)
    try:
        write_plan_pipeline_chart(plan, cost, timeline_png)
        write_memory_chart(estimate, memory_png,
                           title=f"{plan.model}: peak memory per GPU by pipeline stage")
    except OSError as exc:
        raise unwritable(chart, exc, "--chart") from None
    console.print(f"charts: {timeline_png} (pipeline timeline), {memory_png} (memory per stage)")


# --- meshmorph plan --------------------------------------------------------------------------
def _plan(args: argparse.Namespace) -> int:
    if args.max_nodes < 0:
        raise ValueError(f"--max-nodes must be 0 (no limit) or a positive count, got "
                         f"{args.max_nodes}")
    if not math.isfinite(args.tolerance) or args.tolerance < 0:
        raise ValueError(f"--tolerance must be a finite fraction >= 0 (0 = exact), got "
                         f"{args.tolerance}")
    check_writable(args.json, "--json")
    check_writable(args.chart, "--chart")
    model = load_model(args.model, args.seq_len)
    cluster = parse_cluster(args.cluster)
    layerwise = args.layerwise or args.uniform
    options = SearchOptions(top_k=args.top, dtype=args.dtype, compile=args.compile,
                            fp8_scaling=args.fp8_scaling,
                            max_micro_batch=args.max_micro_batch,
                            tolerance=args.tolerance, max_nodes=args.max_nodes or None,
                            allow_async=args.allow_async,
                            weight_prediction=args.weight_prediction, cp_max=args.max_cp,
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
            "search_time_s": result.search_time_s,
            "cluster": cluster.describe(),
            "configurations": result.configurations,
            "configurations_solved": result.configurations_solved,
            "optimality_gap": result.optimality_gap,
            "uniform_best_tokens_per_s": result.estimates[0].tokens_per_s,  # every plan is uniform
            "plans": [plan.to_dict() for plan in result.plans],
        })
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
        write_json(args.json, {
            "search_time_s": result.search_time_s if result else None,
            "regular_search_time_s": regular.search_time_s if regular else None,
            "cluster": cluster.describe(),
            "layerwise": not args.uniform,
            "layerwise_schedules": "runnable" if runnable else "all",
            "returned": choice.source,
            "runnable": choice.runnable,
            "configurations": result.configurations if result else None,
            "configurations_solved": result.configurations_solved if result else None,
            "lower_bound_s": result.lower_bound_s if result else None,
            "optimality_gap": result.optimality_gap if result else None,
            "layerwise_best_tokens_per_s": layerwise,
            "uniform_best_tokens_per_s": uniform,
            "regular_best_tokens_per_s": regular_tokens,
            "regular_best_layerwise_cost_tokens_per_s": regular_lw,
            "plans": [plan.to_dict()],
        })
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
    tp, pp, dp, micro = args.tp, args.pp, args.dp, args.micro_batch
    vpp = args.vpp
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
    num_microbatches = global_batch // (dp * micro)  # m = B / (dp * b)
    plan = Plan(model=args.model, seq_len=model.seq_len, global_batch=global_batch, tp=tp, pp=pp,
                dp=dp, cp=args.cp, zero=args.zero, micro_batch=micro,
                num_microbatches=num_microbatches,
                schedule=schedule, vpp=vpp, sequence_parallel=args.sequence_parallel,
                dtype=args.dtype, overlap_grad_reduce=not args.no_overlap_grad_reduce,
                tp_comm_overlap=args.tp_comm_overlap, fsdp_prefetch=not args.no_fsdp_prefetch,
                overlap_param_gather=not args.no_overlap_param_gather, compile=args.compile,
                fp8_scaling=args.fp8_scaling)
    return plan.with_even_stages(model, recompute)


def _estimate(args: argparse.Namespace) -> int:
    check_writable(args.json, "--json")
    check_writable(args.chart, "--chart")
    cluster = parse_cluster(args.cluster)
    if args.plan is not None:
        stored = load_plan(args.plan)
        source = args.model or stored.model
        model = load_model(source, args.seq_len or stored.seq_len)
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
def register(subparsers: argparse._SubParsersAction) -> None:
    _register_plan(subparsers)
    _register_estimate(subparsers)


def _numerics_flags(parser: argparse.ArgumentParser) -> None:
    """--dtype, --fp8-scaling and --compile: how the plan's blocks compute (plan and estimate)."""
    parser.add_argument("--dtype", choices=DTYPES, default="bf16",
                        help="training dtype (default bf16); fp8: bf16 with the blocks' linear "
                             "layers multiplying in float8 (torchao's float8 training)")
    parser.add_argument("--fp8-scaling", choices=tuple(Fp8Scaling), default="tensorwise",
                        help="with --dtype fp8: float8 scaling recipe (default tensorwise)")
    parser.add_argument("--compile", action="store_true",
                        help="price (and run) every transformer block under torch.compile: fused "
                             "elementwise kernels, fewer kept activations (default: eager)")


def _register_plan(subparsers: argparse._SubParsersAction) -> None:
    plan = subparsers.add_parser(
        "plan", help="search the fastest parallel layouts of a model on a cluster",
        description="Search tp/pp/dp, ZeRO, sequence parallel, micro-batch, schedule, stage "
                    "boundaries and per-layer recompute; print the best plans.",
    )
    plan.add_argument("--model", required=True,
                      help="catalog name, config.json path or package.module:function")
    plan.add_argument("--cluster", required=True, help="GPU:NODESxPER_NODE (h100:4x8) or a .toml")
    plan.add_argument("--global-batch", required=True, type=bounded_int(MAX_GLOBAL_BATCH, "sequences"),
                      help="sequences per optimizer step")
    plan.add_argument("--seq-len", type=bounded_int(MAX_SEQ_LEN, "tokens"), default=None,
                      help="sequence length (default: the model's own)")
    plan.add_argument("--top", type=positive_int, default=5, help="plans to show (default 5)")
    _numerics_flags(plan)
    plan.add_argument("--max-micro-batch", type=positive_int, default=16,
                      help="largest micro-batch size tried (default 16)")
    plan.add_argument("--tolerance", type=float, default=1e-3,
                      help="optimality gap: results are at most this fraction slower than the "
                           "best (default 0.001; 0 = exact)")
    plan.add_argument("--max-nodes", type=int, default=300,
                      help="branch-and-bound nodes per configuration before the rest is left "
                           "with its bound (the proven gap is printed); 0 = no limit")
    plan.add_argument("--max-cp", type=positive_int, default=None,
                      help="largest context-parallel degree (ring attention) tried for "
                           "sequences of 16K tokens and more (default: what the GPUs allow; "
                           "1 = none, the plans meshmorph run accepts)")
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
                           "its buffers; priced only: meshmorph run refuses such plans")
    plan.add_argument("--allow-async", action="store_true",
                      help="also consider schedule async (1F1B without flush, stale weights: "
                           "not the same math as one device; priced by the event simulator in "
                           "its steady state, an optimizer step per micro-batch)")
    plan.add_argument("--weight-prediction", choices=WEIGHT_PREDICTIONS, default="none",
                      help="with --allow-async: the async plans' weights (stash, 2bw, sgd and "
                           "adam hold weight copies that count against memory)")
    plan.add_argument("--profile", type=Path, default=None,
                      help="a Profile JSON (meshmorph profile) replacing catalog figures")
    plan.add_argument("--json", type=Path, default=None, help="write the plans to this JSON file")
    plan.add_argument("--chart", type=Path, default=None,
                      help="write the best plan's pipeline timeline to this PNG (and its memory "
                           "per stage to NAME-memory.png)")
    add_wide(plan)
    plan.set_defaults(func=_plan)


def _register_estimate(subparsers: argparse._SubParsersAction) -> None:
    est = subparsers.add_parser(
        "estimate", help="predict step time and memory of one layout",
        description="Predict one plan's step time (with its terms), throughput, MFU and memory "
                    "per pipeline stage. Exit code 1 when it does not fit the devices' memory.",
    )
    est.add_argument("--model", default=None, help="catalog name, config.json or factory "
                                                   "(default with --plan: the plan's model)")
    est.add_argument("--cluster", required=True, help="GPU:NODESxPER_NODE (h100:4x8) or a .toml")
    est.add_argument("--plan", type=Path, default=None,
                     help="plan JSON (a plan, or the output of 'meshmorph plan --json')")
    est.add_argument("--tp", type=positive_int, default=None, help="tensor-parallel degree")
    est.add_argument("--pp", type=positive_int, default=None, help="pipeline-parallel degree")
    est.add_argument("--dp", type=positive_int, default=None, help="data-parallel degree")
    est.add_argument("--cp", type=positive_int, default=1,
                     help="context-parallel degree: each sequence split over cp ranks (ring "
                          "attention; 2 cp must divide the sequence length; default 1)")
    est.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0, help="ZeRO stage")
    est.add_argument("--micro-batch", type=positive_int, default=1, help="sequences per micro-batch")
    est.add_argument("--global-batch", type=bounded_int(MAX_GLOBAL_BATCH, "sequences"), default=None,
                     help="sequences per step (default dp x micro-batch x pp)")
    est.add_argument("--seq-len", type=bounded_int(MAX_SEQ_LEN, "tokens"), default=None,
                     help="sequence length (default: the model's own)")
    est.add_argument("--schedule", choices=[str(s) for s in Schedule], default=None,
                     help="pipeline schedule (default 1f1b, interleaved when --vpp > 1)")
    est.add_argument("--vpp", type=positive_int, default=1,
                     help="model chunks per pipeline rank (interleaved)")
    est.add_argument("--recompute", choices=[str(r) for r in Recompute], default="none",
                     help="activation recompute of every block")
    est.add_argument("--no-overlap-grad-reduce", action="store_true",
                     help="reduce gradients after the backward, fully exposed (default: bucket by "
                          "bucket during the last backward, as DDP and FSDP2 do)")
    est.add_argument("--tp-comm-overlap", action="store_true",
                     help="overlap tensor-parallel communication with the GEMMs (Megatron-LM's "
                          "--tp-comm-overlap; needs --sequence-parallel; priced only: meshmorph "
                          "run refuses it)")
    est.add_argument("--no-fsdp-prefetch", action="store_true",
                     help="ZeRO-3 without FSDP prefetch: each gather exposed, one unit gathered")
    est.add_argument("--no-overlap-param-gather", action="store_true",
                     help="ZeRO-1/2 without overlapping the parameter all-gather with the next "
                          "forward (Megatron-LM's --overlap-param-gather off): every gather exposed")
    est.add_argument("--sequence-parallel", action="store_true",
                     help="Megatron sequence parallelism (needs tp > 1)")
    _numerics_flags(est)
    est.add_argument("--profile", type=Path, default=None,
                      help="a Profile JSON (meshmorph profile) replacing catalog figures")
    est.add_argument("--json", type=Path, default=None,
                     help="write the plan and its prediction to this JSON file")
    est.add_argument("--chart", type=Path, default=None,
                     help="write the pipeline timeline to this PNG (and NAME-memory.png)")
    add_wide(est)
    est.set_defaults(func=_estimate)
