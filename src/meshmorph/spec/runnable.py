"""What the runtime runs: every rule ``meshmorph run`` refuses a plan by, each stated once, with
the message a user sees.

``check_runnable`` applies them in order (``check_plan``: after ``Plan.check_against``, what
``meshmorph run`` and every rank check before they start); the planners call the same
functions, so a plan they hand out is one ``meshmorph run`` runs. Pure Python (no torch):
planning a job needs nothing else.

- **The model** (``model_refusal``): the runtime rebuilds gpt and llama decoders, at the plan's
  sequence length; interleaved chunks need pp > 1.
- **Context parallelism** (``refuse_context_parallel``): meshmorph prices and plans cp > 1, it
  does not run it. torch's ``context_parallel`` rotates K/V through ``scaled_dot_product_attention``'s
  flash and memory-efficient CUDA kernels; the runtime trains on CPU processes over gloo as
  well, and its models, meshes and checkpoints split no sequence.
- **The asynchronous executor** (``async_refusal``; a schedule without flush, run/async_pipe/):
  one model chunk per rank, pp >= 2, tp = dp = 1, no fp16, one strategy for every layer, and
  no checkpoint to resume from (``async_job_refusal``).
- **Per-layer strategies** (``layerwise_refusal``): the runtime runs a plan whose layers list
  their own tp/dp/ZeRO when

  - pp = 1, or pp > 1 under a synchronous schedule (``RUNNABLE_PIPELINE_SCHEDULES``);
  - the model does not tie its embedding and head, or the two layers share tp and ZeRO stage
    (under pp > 1, with a schedule of ``TIED_PIPELINE_SCHEDULES``, the last stage's head keeps
    its own copy of the embedding, laid out alike, and the two copies' gradients are summed),
    with a ZeRO stage below 2 when they have dp > 1 and sit in one chunk (FSDP2 cannot shard
    one matrix for two layers run apart);
  - with sequence parallelism, every layer's tp degree divides the sequence length (each tp
    rank holds s / tp positions of the hidden state; a tp 1 layer holds whole sequences);
  - every stage lists its layer strategies (or none does), and every two tp degrees of the plan
    nest (one divides the other); overlap_grad_reduce and fsdp_prefetch are on.
- **Split backward** (``split_backward_refusal``): under zb, zbv and dualpipev no layer runs
  ZeRO-3 over dp > 1 (torch pipelining's weight pass misses the gathered parameters FSDP2
  frees after forward, and the gradients are lost); ``rounds_refusal``: torch's interleaved
  runtimes run the micro-batches in equal rounds.
- **Overlap switches** (``overlap_refusal``): tensor-parallel communication overlap runs as
  torch's async tensor parallel (inductor's micro-pipelined TP over CUDA symmetric memory), so
  only on CUDA and with compiled blocks; a gradient reduction after the backward only at pp 1,
  for ZeRO-0 where DDP runs the chunk and for ZeRO-1. ``overlap_param_gather`` is realised by a
  uniform chunk's FSDP2 units (ZeRO-1/2); a layerwise plan's ZeRO-2 layers gather in their own
  forward and its ZeRO-1 layers after the optimizer step, as the cost model prices a layer run
  alone, so the switch refuses nothing.
- **fp16** (``fp16_refusal``): loss scaling runs in the synchronous step of plans without
  per-layer strategies.
- **fp8** (``fp8_refusal``): the runtime converts the transformer blocks' linear layers to
  torchao's float8 training (run/model/float8.py) under every synchronous and asynchronous
  layout it runs (data parallel, FSDP2, tensor and sequence parallel with torch's plain styles,
  pipelines, per-layer strategies, compiled blocks); it needs torchao installed. A job in fp8
  (``fp8_job_refusal``) runs its own plan or a plan file, not ``--plan auto`` or ``--elastic``:
  both ask the planner for plans of the local CPU processes, and the cost model prices float8
  GEMMs only on GPUs whose catalog entry lists an fp8 peak.

A plan whose stages list layer strategies runs them layer by layer even where they all equal the
plan's own tp, dp and zero (run/parallel/segments.py, priced so by cost/segments.py: the per-layer
search's prices add up layer by layer); the plan without the list runs each chunk as a whole.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

from meshmorph.schedule.table import Schedule
from meshmorph.spec.model import ModelSpec
from meshmorph.spec.plan import LayerStrategy, Plan, PlanError, StagePlan

RUNTIME_ARCHS = ("gpt", "llama")
"""The decoders the runtime builds (run/model/decoder.py)."""

RUNNABLE_PIPELINE_SCHEDULES = (Schedule.GPIPE, Schedule.ONE_F_ONE_B, Schedule.ZERO_BUBBLE,
                               Schedule.INTERLEAVED, Schedule.ZBV, Schedule.DUALPIPEV)
"""The pipeline schedules a layerwise plan with pp > 1 runs: one chunk per pipeline rank (gpipe,
1f1b, zb), vpp chunks per rank (interleaved) or two in a V (zbv, dualpipev)."""

TIED_PIPELINE_SCHEDULES = tuple(s for s in RUNNABLE_PIPELINE_SCHEDULES if s.info.chunks_per_rank
                                == 1 and not s.info.split_backward)
"""The schedules a layerwise pipeline (pp > 1) of a model with a tied embedding and head runs:
one chunk per rank and a full backward, the head's copy on the last rank (gpipe, 1f1b)."""

ROUNDS_TORCH_CLASSES = ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble")
"""torch pipelining's runtimes that run the micro-batches in rounds of max(1, m // pp)."""


# --- each layer's strategy ---------------------------------------------------------------------
def plan_strategy(plan: Plan) -> LayerStrategy:
    """The plan's own split of a stage's devices: every layer's, where a stage lists none."""
    return LayerStrategy(tp=plan.tp, dp=plan.dp, zero=plan.zero)


def stage_strategies(plan: Plan, stage: StagePlan) -> tuple[LayerStrategy, ...]:
    """Each layer's strategy in ``stage``: the listed ones, or the plan's for every layer."""
    return stage.layer_strategies or (plan_strategy(plan),) * stage.num_layers


def lists_layer_strategies(plan: Plan) -> bool:
    """Whether any stage of ``plan`` lists per-layer strategies."""
    return any(stage.layer_strategies is not None for stage in plan.stages)


def tp_degrees_of(plan: Plan) -> set[int]:
    """Every tp degree a plan's layers use, and the plan's own (its data layout)."""
    return {plan.tp} | {s.tp for stage in plan.stages for s in stage.layer_strategies or ()}


# --- the model and the shape ---------------------------------------------------------------------
def model_refusal(model: ModelSpec, plan: Plan) -> str | None:
    """Why the runtime cannot build ``model`` for ``plan``; None when it can."""
    if model.arch not in RUNTIME_ARCHS:
        return (f"model {model.name!r} has arch {model.arch!r}; the runtime builds only 'gpt' "
                "and 'llama' decoders (catalog models or HF configs)")
    if plan.seq_len != model.seq_len:
        return (f"plan seq_len {plan.seq_len} != model seq_len {model.seq_len}; load the model "
                f"at seq_len {plan.seq_len} (ModelSpec.with_seq_len) or re-plan")
    if plan.pp == 1 and plan.num_chunks > 1:
        return f"vpp {plan.vpp} needs pp > 1; set vpp 1 or raise pp"
    return None


def context_parallel_refusal(plan: Plan, where: str = "meshmorph run") -> str | None:
    """Why ``where`` does not run ``plan``'s context parallelism; None at cp 1."""
    if plan.cp == 1:
        return None
    return (f"{where} does not run context parallelism: the plan has cp {plan.cp} (ring "
            f"attention needs torch's context_parallel, which runs on CUDA SDPA kernels, and "
            f"meshmorph's runtime does not split sequences); re-plan with cp 1 (meshmorph plan "
            f"--max-cp 1) or fold the {plan.cp} ranks into dp or tp, at a shorter sequence if "
            f"it no longer fits")


def refuse_context_parallel(plan: Plan, where: str = "meshmorph run") -> None:
    """A PlanError naming the constraint and a way out when ``plan`` has cp > 1."""
    _raise(context_parallel_refusal(plan, where))


def fp16_refusal(plan: Plan, *, layer_strategies: bool | None = None) -> str | None:
    """Why ``plan`` cannot run in fp16: loss scaling runs in the synchronous step of a plan
    without per-layer strategies (``layer_strategies``: whether the plan is to list them; by
    default whether it does). None when it can."""
    if plan.dtype != "fp16":
        return None
    if layer_strategies is None:
        layer_strategies = lists_layer_strategies(plan)
    if not plan.schedule.info.flush:
        what = f"schedule '{plan.schedule}' has no fp16 loss scaling (each stage steps on its own)"
    elif layer_strategies:
        what = "layerwise plans have no fp16 loss scaling (one scale over layers on other meshes)"
    else:
        return None
    return f"{what}; run fp32 or bf16 (dtype bf16)"


FP8_MODULE = "torchao"
"""The package whose float8 training the runtime runs dtype fp8 with (run/model/float8.py)."""


def fp8_refusal(plan: Plan) -> str | None:
    """Why ``meshmorph run`` cannot run ``plan``'s float8 linear layers here: torchao is not
    installed (looked up without importing it); None for another dtype, or where it is."""
    if plan.dtype != "fp8" or importlib.util.find_spec(FP8_MODULE) is not None:
        return None
    return ("dtype fp8 runs the transformer blocks' linear layers through torchao's float8 "
            "training, and torchao is not installed; pip install 'meshmorph[run]' (or pip "
            "install torchao), or run dtype bf16")


FP8_SEARCH_REFUSAL = (
    "the planner prices float8 GEMMs only on GPUs whose catalog entry lists an fp8 peak, and "
    "{what} searches plans for the local CPU processes (the catalog's 'cpu' entry, which lists "
    "none)")
"""The reason of ``fp8_job_refusal``; ``{what}`` names the option."""


def fp8_job_refusal(dtype: str, *, plan_auto: bool, elastic: bool) -> str | None:
    """Why a job in ``dtype`` fp8 cannot run with ``--plan auto`` or ``--elastic`` (which picks
    the next plan after a membership change through the same search), naming a way out; None
    when it can."""
    if dtype != "fp8" or not (plan_auto or elastic):
        return None
    what = "--plan auto" if plan_auto else "an --elastic run, after a membership change,"
    way_out = ("leave --plan out (pure data parallelism over --nproc) or give --plan FILE, a "
               "plan with dtype fp8" if plan_auto
               else "run without --elastic (Ctrl-C and --resume still work)")
    return (f"dtype fp8: {FP8_SEARCH_REFUSAL.format(what=what)}; {way_out}, or run dtype bf16")


def check_fp8_job(dtype: str, *, plan_auto: bool, elastic: bool) -> None:
    """Raise PlanError with ``fp8_job_refusal``'s reason, if any."""
    _raise(fp8_job_refusal(dtype, plan_auto=plan_auto, elastic=elastic))


# --- the asynchronous executor -----------------------------------------------------------------
def async_refusal(plan: Plan) -> str | None:
    """Why the asynchronous executor (a schedule without flush, run/async_pipe/) cannot run
    ``plan``, naming a way out; None when it can (or the schedule flushes)."""
    if plan.schedule.info.flush:
        return None
    name = f"schedule '{plan.schedule}'"
    if plan.pp < 2:
        return (f"{name} pipelines stages over ranks: it needs pp >= 2; raise pp or use schedule "
                f"{Schedule.ONE_F_ONE_B}")
    if plan.tp != 1 or plan.dp != 1:
        return (f"{name} runs one model chunk per rank with tp 1 and dp 1, got tp {plan.tp} dp "
                f"{plan.dp}; set tp = dp = 1 (pp = the number of processes) or use a "
                f"synchronous schedule ({Schedule.ONE_F_ONE_B}, {Schedule.ZERO_BUBBLE}, "
                f"{Schedule.ZBV})")
    if plan.vpp != 1:
        return f"{name} holds one chunk per rank, got vpp {plan.vpp}; set vpp 1"
    return fp16_refusal(plan) or (
        _one_strategy_refusal(plan) if lists_layer_strategies(plan) else None)


def _one_strategy_refusal(plan: Plan) -> str:
    """The asynchronous executor's rule for layer strategies."""
    return (f"schedule '{plan.schedule}' runs one strategy for every layer; drop "
            f"layer_strategies or use schedule '{Schedule.ONE_F_ONE_B}'")


def async_job_refusal(plan: Plan, *, resume: bool, elastic: bool) -> str | None:
    """Why a job cannot run ``plan`` asynchronously with ``--resume`` or ``--elastic``."""
    if plan.schedule.info.flush or not (resume or elastic):
        return None
    return (f"schedule '{plan.schedule}' writes no checkpoint and has no step boundary to "
            "restart from: run it without --resume and --elastic, or use a synchronous schedule")


# --- per-layer strategies ----------------------------------------------------------------------
def runnable_shape_refusal(model: ModelSpec, plan: Plan) -> str | None:
    """Why no plan of ``plan``'s shape (pp, vpp, schedule, sequence parallelism, dtype) may list
    per-layer strategies, naming a way out; None when some may."""
    if plan.pp > 1 and plan.schedule not in RUNNABLE_PIPELINE_SCHEDULES:
        names = ", ".join(str(s) for s in RUNNABLE_PIPELINE_SCHEDULES)
        return (f"layerwise plans with pp > 1 run the schedules {names} (this one has pp "
                f"{plan.pp}, vpp {plan.vpp}, schedule {plan.schedule}); set one of them, or "
                "drop layer_strategies")
    if model.tied_embeddings and plan.pp > 1 and plan.schedule not in TIED_PIPELINE_SCHEDULES:
        names = " or ".join(str(s) for s in TIED_PIPELINE_SCHEDULES)
        return (f"{model.name} ties its embedding and head; layerwise pipelines keep the two "
                f"copies equal under schedule {names} (this one has {plan.schedule}); set one "
                "of them, or plan pp 1")
    if not plan.schedule.info.flush:
        return _one_strategy_refusal(plan)
    return fp16_refusal(plan, layer_strategies=True)


def tied_ends_refusal(model: ModelSpec, embed: LayerStrategy, head: LayerStrategy, *,
                      apart: bool = False) -> str | None:
    """Why a model's embedding and head may not run under ``embed`` and ``head`` (a tied matrix
    needs one layout; in one chunk it is one parameter, which FSDP2 does not shard); None when
    they may. ``apart``: the two layers are in different chunks (pp > 1), each holding its own
    copy."""
    if not model.tied_embeddings:
        return None
    if (embed.tp, embed.zero) != (head.tp, head.zero):
        return (f"{model.name} ties its embedding and head (one matrix), but they have tp "
                f"{embed.tp} / zero {embed.zero} and tp {head.tp} / zero {head.zero}; give both "
                "layers the same tp and ZeRO stage")
    if embed.zero >= 2 and embed.dp > 1 and not apart:
        return (f"{model.name} ties its embedding and head, and FSDP2 cannot shard one matrix "
                f"for two layers run apart (zero {embed.zero}); give the embedding and head "
                "zero 0 or 1")
    return None


def _layout_refusal(plan: Plan) -> str | None:
    """Why the layers' tp degrees cannot hand activations to each other; None when they can."""
    degrees = sorted(tp_degrees_of(plan))
    for low, high in zip(degrees, degrees[1:], strict=False):
        if high % low:
            return (f"layer tp degrees {low} and {high} do not nest; the runtime moves "
                    "activations only between tp's where one divides the other")
    uneven = [tp for tp in degrees if plan.seq_len % tp] if plan.sequence_parallel else []
    if uneven:
        return (f"sequence parallelism splits the {plan.seq_len} positions of a sequence "
                f"over each layer's tp ranks, and tp {uneven[0]} does not divide them; "
                "choose tp's that divide seq_len, or set sequence_parallel false")
    return None


def layerwise_refusal(model: ModelSpec, plan: Plan) -> str | None:
    """Why the runtime refuses ``plan`` (a plan listing layer strategies), naming a way out;
    None when it runs it."""
    shape = runnable_shape_refusal(model, plan)
    if shape is not None:
        return shape
    if any(stage.layer_strategies is None for stage in plan.stages):
        return ("a layerwise plan lists layer_strategies on every stage or on none; give the "
                "other stages theirs (one per layer: the stage's tp/dp/zero)")
    refusal = split_backward_refusal(plan) or _layout_refusal(plan)
    if refusal is not None:
        return refusal
    first, last = plan.stages[0].layer_strategies, plan.stages[-1].layer_strategies
    assert first is not None and last is not None
    return tied_ends_refusal(model, first[0], last[-1], apart=plan.num_chunks > 1)


def check_layerwise_runnable(model: ModelSpec, plan: Plan) -> None:
    """Raise PlanError naming the rule ``plan`` fails (``layerwise_refusal``), if any."""
    _raise(layerwise_refusal(model, plan))


def layerwise_runnable(model: ModelSpec, plan: Plan) -> bool:
    """Whether meshmorph runs ``plan``: a plan without layer strategies runs as a whole; one
    with them must pass ``layerwise_refusal``."""
    return not lists_layer_strategies(plan) or layerwise_refusal(model, plan) is None


# --- pipeline schedules ------------------------------------------------------------------------
def zero_runs_under(schedule: Schedule, zero: int, dp: int) -> bool:
    """Whether a plan (or one layer of a layerwise plan) at ZeRO ``zero`` over ``dp`` ranks runs
    under ``schedule``: torch pipelining's split backward (zb, zbv, dualpipev) loses ZeRO-3's
    weight gradients, so ZeRO-3 over more than one rank does not run under it."""
    return not (schedule.split_backward and zero == 3 and dp > 1)


def split_backward_refusal(plan: Plan) -> str | None:
    """Why a layer of ``plan`` may not run under its split-backward schedule (zb, zbv,
    dualpipev): ZeRO-3 over more than one rank; None when every layer may."""
    if plan.pp == 1 or not plan.schedule.split_backward:
        return None
    for chunk, stage in enumerate(plan.stages):
        for offset, strategy in enumerate(stage_strategies(plan, stage)):
            if not zero_runs_under(plan.schedule, strategy.zero, strategy.dp):
                where = (f"layer {stage.start + offset} (chunk {chunk})"
                         if stage.layer_strategies is not None else "the plan")
                return (f"{where} runs ZeRO-3 over dp {strategy.dp} under schedule "
                        f"{plan.schedule}: a zero-bubble schedule with ZeRO-3 loses its weight "
                        "gradients in torch's pipelining (the split backward's weight pass "
                        "misses the parameters FSDP2 gathered and freed after forward); use "
                        f"zero 2 (or 0/1), or schedule {Schedule.ONE_F_ONE_B} or "
                        f"{Schedule.INTERLEAVED}")
    return None


def rounds_refusal(plan: Plan) -> str | None:
    """Why torch's interleaved runtime (``ROUNDS_TORCH_CLASSES``) cannot split ``plan``'s
    micro-batches into equal rounds of pp; None when it can."""
    name = plan.schedule.info.torch_class
    if plan.pp == 1 or name not in ROUNDS_TORCH_CLASSES:
        return None
    m = plan.num_microbatches
    rounds = max(1, m // plan.pp)
    if m % rounds == 0:
        return None
    return (f"schedule {plan.schedule} runs micro-batches in rounds of pp {plan.pp} (torch's "
            f"{name}): num_microbatches {m} is not a multiple of {rounds} rounds; use a "
            "multiple of pp")


# --- overlap switches --------------------------------------------------------------------------
def defers_grad_reduce(plan: Plan) -> bool:
    """Whether the runtime reduces this plan's gradients after the backward itself
    (``overlap_grad_reduce`` off): ZeRO-0's DDP under ``no_sync`` for every micro-batch, then
    one all-reduce per gradient (tp 1), or ZeRO-1's FSDP2 units without gradient sync, then one
    reduce-scatter per unit; dp > 1 and pp 1 (``overlap_refusal`` refuses it to layerwise
    plans)."""
    if plan.overlap_grad_reduce or plan.dp == 1 or plan.pp > 1 or plan.cp > 1:
        return False
    return plan.zero == 1 or (plan.zero == 0 and plan.tp == 1)


def overlap_refusal(plan: Plan, *, cuda: bool = False) -> str | None:
    """Why the runtime does not realise an overlap switch of ``plan``, saying what to set;
    ``cuda``: the ranks train on CUDA devices."""
    if plan.tp_comm_overlap and not cuda:
        return ("tp_comm_overlap runs as torch's async tensor parallel (inductor's "
                "micro-pipelined TP over CUDA symmetric memory), which CPU processes cannot run; "
                "set tp_comm_overlap false to run the plan here (estimate prices both)")
    if plan.tp_comm_overlap and not plan.compile:
        return ("tp_comm_overlap runs as torch's async tensor parallel, an inductor pass over "
                "compiled blocks; set compile true in the plan (or [train] compile = true), or "
                "tp_comm_overlap false")
    if not plan.overlap_grad_reduce and plan.grad_replicas > 1 and not defers_grad_reduce(plan):
        return (f"overlap_grad_reduce false: the runtime reduces gradients after the backward "
                f"only with pp 1 and cp 1, for zero 0 where DDP runs the chunk (tp 1) and for "
                f"zero 1, not with tp {plan.tp}, pp {plan.pp}, zero {plan.zero}, cp {plan.cp}; "
                f"set overlap_grad_reduce true (FSDP2 and torch's pipelining reduce during the "
                f"backward)")
    if lists_layer_strategies(plan) and not (plan.overlap_grad_reduce and plan.fsdp_prefetch):
        return ("layerwise plans run with overlap_grad_reduce and fsdp_prefetch on; set both "
                "true or drop layer_strategies")
    return None


# --- all of them -------------------------------------------------------------------------------
def runtime_refusal(model: ModelSpec, plan: Plan, *, cuda: bool = False) -> str | None:
    """Why ``meshmorph run`` refuses ``plan`` (a plan ``Plan.check_against`` accepted), the
    first rule it fails in the module docstring's order; None when it runs it. ``cuda``: the
    ranks train on CUDA devices."""
    rules: list[Callable[[], str | None]] = [
        lambda: model_refusal(model, plan), lambda: context_parallel_refusal(plan),
        lambda: fp8_refusal(plan)]
    if not plan.schedule.info.flush:  # the asynchronous executor's own rules
        rules.append(lambda: async_refusal(plan))
    else:
        if lists_layer_strategies(plan):
            rules.append(lambda: layerwise_refusal(model, plan))
        rules += [lambda: overlap_refusal(plan, cuda=cuda), lambda: split_backward_refusal(plan),
                  lambda: fp16_refusal(plan), lambda: rounds_refusal(plan)]
    return next((refusal for rule in rules if (refusal := rule()) is not None), None)


def check_runnable(model: ModelSpec, plan: Plan, *, cuda: bool = False) -> None:
    """Raise PlanError naming the first rule ``plan`` fails (``runtime_refusal``), if any."""
    _raise(runtime_refusal(model, plan, cuda=cuda))


def check_plan(model: ModelSpec, plan: Plan, world_size: int, *, cuda: bool) -> None:
    """Refuse, before any process starts, a plan this model cannot run on ``world_size``
    processes: the plan's own checks (``Plan.check_against``), then every rule above for ranks
    on CUDA devices (``cuda``) or not."""
    plan.check_against(model, world_size)
    check_runnable(model, plan, cuda=cuda)


def _raise(refusal: str | None) -> None:
    if refusal is not None:
        raise PlanError(refusal)
