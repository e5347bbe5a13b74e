"""Plan: the whole parallel layout of one training job, serialised to JSON exactly.

Ranks are laid out as Megatron-Core does: tensor parallel innermost, then context parallel, then
data parallel, then pipeline (``rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank``),
so tp groups, and then tp x cp groups, stay inside a node. Context parallelism (``cp``) splits each
sequence over cp ranks (ring attention with causal load balancing: every rank holds two chunks of
``seq_len / (2 cp)`` tokens); its ranks share the same sequences, so ``global_batch`` counts dp
alone, and parameters are replicated (gradients reduced) over dp x cp.
With ``vpp`` virtual stages, ``stages`` holds ``pp * vpp`` model chunks and chunk ``c`` runs on
pipeline rank ``c % pp`` (Megatron's interleaved order), except under the V schedules (zbv,
dualpipev: vpp 2), where rank ``r`` holds chunks ``r`` and ``2 pp - 1 - r``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from enum import IntEnum, StrEnum
from pathlib import Path
from typing import Any, TypeVar

from meshmorph.files import read_document
from meshmorph.schedule.table import Schedule
from meshmorph.spec.model import ModelSpec, Recompute


class WeightPrediction(StrEnum):
    """Weights an asynchronous (``async``) pipeline computes with: ``none`` (stale), ``stash``
    (the backward uses the forward's weights), ``2bw`` (PipeDream-2BW), ``sgd`` (SpecTrain's
    momentum-SGD prediction), ``adam`` (Adam's update direction extrapolated)."""

    NONE = "none"
    STASH = "stash"
    TWO_BW = "2bw"
    SGD = "sgd"
    ADAM = "adam"


WEIGHT_PREDICTIONS = tuple(str(w) for w in WeightPrediction)
"""Values of ``Plan.weight_prediction``."""


class ZeroStage(IntEnum):
    """ZeRO stage over a data-parallel group; an int in JSON (0-3)."""

    REPLICATE = 0
    """Everything replicated (DDP)."""
    OPTIMIZER = 1
    """Optimizer moments sharded."""
    GRADIENTS = 2
    """Gradients sharded too (FSDP2, parameters kept gathered over the step)."""
    PARAMETERS = 3
    """Parameters sharded too (FSDP2, resharded after forward and backward)."""


class DType(StrEnum):
    """Floating-point format of compute or of gradient reductions."""

    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"
    FP8 = "fp8"
    """bf16 mixed precision whose transformer blocks' linear layers multiply in float8
    (torchao's float8 training, ``Plan.fp8_scaling``); weights, activations and gradients stay
    16-bit, each GEMM operand is scaled and cast on the fly. A compute dtype only."""

    @property
    def bytes(self) -> int:
        """Bytes of one element as tensors are kept (fp8 keeps 16-bit tensors)."""
        return 4 if self == DType.FP32 else 2


class Fp8Scaling(StrEnum):
    """How a float8 linear layer scales its operands (torchao's recipe names): ``tensorwise``
    (one scale per tensor), ``rowwise`` (one per row, more accurate, slower kernels) or
    ``rowwise_with_gw_hp`` (rowwise, the weight gradient's GEMM kept in bf16)."""

    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"
    ROWWISE_WITH_GW_HP = "rowwise_with_gw_hp"


class PlanError(ValueError):
    """A Plan that cannot exist: the message names the constraint that failed and a way out."""


_E = TypeVar("_E", bound=StrEnum)


def _member(name: str, kind: type[_E], value: object) -> _E:
    """``value`` as a member of ``kind``; a PlanError naming the field and the choices otherwise."""
    if type(value) is kind:  # already a member (every Plan the planner copies)
        return value  # type: ignore[return-value]
    try:
        return kind(value)
    except ValueError:
        raise PlanError(f"{name} must be one of {', '.join(kind)}, got {value!r}") from None


def _zero_stage(name: str, value: object) -> ZeroStage:
    """``value`` as a ZeroStage; a PlanError naming the field otherwise."""
    if type(value) is ZeroStage:  # already a member (every Plan the planner copies)
        return value
    if value not in (0, 1, 2, 3):
        raise PlanError(f"{name} must be 0, 1, 2 or 3, got {value}")
    return ZeroStage(int(value))  # type: ignore[call-overload]


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerStrategy:
    """How one layer of a stage splits the stage's devices (plan/strategy_dp.py chooses them)."""

    tp: int
    """Tensor-parallel degree of the layer (its ranks consecutive, inside a node)."""
    dp: int
    """Data-parallel degree of the layer; tp x dp equals the stage's devices (plan tp x dp)."""
    zero: ZeroStage = ZeroStage.REPLICATE
    """ZeRO stage of the layer's parameters over its data-parallel group (0-3)."""

    def __post_init__(self) -> None:
        if self.tp < 1 or self.dp < 1:
            raise PlanError(f"layer strategy tp {self.tp} dp {self.dp}: degrees must be >= 1")
        object.__setattr__(self, "zero", _zero_stage("layer strategy zero", self.zero))

    def to_dict(self) -> dict[str, int]:
        return {"tp": self.tp, "dp": self.dp, "zero": self.zero}


@dataclass(frozen=True, slots=True, kw_only=True)
class StagePlan:
    """One pipeline model chunk: a contiguous range of layers and their recompute."""

    start: int
    """Index of the first layer (into ModelSpec.layers)."""
    stop: int
    """One past the last layer."""
    recompute: tuple[Recompute, ...]
    """Recompute mode of each layer in the range."""
    gpu: str | None = None
    """GPU type of the ranks running this chunk (heterogeneous clusters), None if uniform."""
    layer_strategies: tuple[LayerStrategy, ...] | None = None
    """Each layer's own tp/dp/ZeRO split of the stage's devices (layerwise plans); None: every
    layer uses the plan's tp, dp and zero."""

    def __post_init__(self) -> None:
        if self.stop <= self.start:
            raise PlanError(f"stage [{self.start}, {self.stop}) holds no layer")
        if len(self.recompute) != self.stop - self.start:
            raise PlanError(f"stage [{self.start}, {self.stop}) lists {len(self.recompute)} "
                            f"recompute modes for {self.stop - self.start} layers")
        if self.layer_strategies is not None:
            object.__setattr__(self, "layer_strategies", tuple(
                s if isinstance(s, LayerStrategy) else LayerStrategy(**s)
                for s in self.layer_strategies))
            if len(self.layer_strategies) != self.stop - self.start:
                raise PlanError(f"stage [{self.start}, {self.stop}) lists "
                                f"{len(self.layer_strategies)} layer strategies for "
                                f"{self.stop - self.start} layers; give one per layer or none")

    @property
    def num_layers(self) -> int:
        return self.stop - self.start


BOOL_FIELDS = ("sequence_parallel", "overlap_grad_reduce", "tp_comm_overlap", "fsdp_prefetch",
               "overlap_param_gather", "compile")
"""The Plan's switches: each must be a bool (``Plan.__post_init__`` refuses anything else)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """A hybrid-parallel layout; the predicted figures travel with it when a planner made it."""

    model: str
    """Model source (catalog name, config path or factory) the plan was made for."""
    seq_len: int
    """Sequence length s."""
    global_batch: int
    """Sequences per optimizer step."""
    tp: int = 1
    """Tensor-parallel degree (inside a node)."""
    pp: int = 1
    """Pipeline-parallel degree."""
    dp: int = 1
    """Data-parallel degree."""
    cp: int = 1
    """Context-parallel degree: each sequence split over cp ranks (ring attention, causal load
    balancing: two chunks of seq_len / (2 cp) tokens per rank); 1 = off."""
    zero: ZeroStage = ZeroStage.REPLICATE
    """ZeRO stage over the data-parallel group: 0 replicate, 1 optimizer, 2 +grads, 3 +params (FSDP)."""
    micro_batch: int = 1
    """Sequences per micro-batch on one data-parallel rank."""
    num_microbatches: int = 1
    """Micro-batches per step (gradient accumulation / pipeline depth)."""
    schedule: Schedule = Schedule.ONE_F_ONE_B
    """Pipeline schedule."""
    vpp: int = 1
    """Virtual pipeline stages (model chunks) per pipeline rank; > 1 only for interleaved."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism in the tensor-parallel regions."""
    dtype: DType = DType.BF16
    """Compute dtype (``bf16``, ``fp16``, ``fp32``, or ``fp8``: bf16 with float8 GEMMs in the
    blocks' linear layers, as torchao's float8 training runs them); parameters, gradients and Adam moments are kept in
    fp32 whatever it is (mixed precision)."""
    reduce_dtype: DType = DType.FP32
    """Dtype of data-parallel gradient reductions: ``fp32`` (meshmorph's default, FSDP2's
    ``reduce_dtype``), or a 16-bit one as Megatron-LM 2021 reduced fp16 gradients."""
    fp8_scaling: Fp8Scaling = Fp8Scaling.TENSORWISE
    """With dtype ``fp8``: how the float8 linear layers scale their operands (``Fp8Scaling``);
    written to JSON only for fp8 plans."""
    stages: tuple[StagePlan, ...] = ()
    """``pp * vpp`` model chunks in order."""
    weight_prediction: WeightPrediction = WeightPrediction.NONE
    """Weights under ``schedule = "async"`` (``WeightPrediction``); ``none`` with the others."""
    overlap_grad_reduce: bool = True
    """Data-parallel gradient reduction overlapped with the last backward, bucket by bucket
    (torch DDP's and FSDP2's default, Megatron-LM's ``--overlap-grad-reduce``); False: gradients
    reduced after the backward, the collective fully exposed."""
    tp_comm_overlap: bool = False
    """Tensor-parallel communication overlapped with the GEMMs it feeds (Megatron-LM's
    ``--tp-comm-overlap``, TransformerEngine's userbuffers); needs sequence parallelism.
    meshmorph's runtime realises it on CUDA as torch's async tensor parallel (inductor's
    micro-pipelined TP, with ``compile``); it refuses the plan on CPU."""
    fsdp_prefetch: bool = True
    """ZeRO-3: the next unit's all-gather issued while this unit computes (FSDP2's forward and
    backward prefetch), one more gathered unit held; False: each gather on the critical path."""
    overlap_param_gather: bool = True
    """ZeRO-1/2: the updated parameters' all-gather (one per FSDP2 unit, in the compute dtype)
    overlapped with the next step's forward, each unit's gather issued while the unit before it
    computes, so the first forward waits only for its own unit (Megatron-LM's
    ``--overlap-param-gather``); False: each unit's gather on the critical path."""
    compile: bool = False
    """Each transformer block compiled by ``torch.compile``: elementwise work fused into few
    kernels (``CostCoefficients.elementwise_passes``), and pointwise results that feed no matmul
    recomputed in backward. False: eager, a kernel per op, and under autocast every fp32 norm
    input and each projection's own 16-bit copy of a norm's output kept for backward
    (``RuntimeActivation``)."""
    predicted: dict[str, Any] | None = field(default=None, compare=False)
    """Predicted figures (step_time_s, tokens_per_s, ...) from the cost model, if any."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise PlanError(f"model must name a model (a catalog name such as 'gpt-tiny', a "
                            f"config.json path or a package.module:function), got {self.model!r}")
        for name, kind in (("schedule", Schedule), ("dtype", DType), ("reduce_dtype", DType),
                           ("fp8_scaling", Fp8Scaling), ("weight_prediction", WeightPrediction)):
            object.__setattr__(self, name, _member(name, kind, getattr(self, name)))
        object.__setattr__(self, "zero", _zero_stage("zero", self.zero))
        if self.predicted is not None and not isinstance(self.predicted, dict):
            raise PlanError(f"predicted must be an object of figures (the planner writes it), "
                            f"got {self.predicted!r}; leave it out")
        for name in BOOL_FIELDS:  # a JSON "yes" or 1 would read as true everywhere it is tested
            if not isinstance(getattr(self, name), bool):
                raise PlanError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("tp", "pp", "dp", "cp", "micro_batch", "num_microbatches", "vpp", "seq_len",
                     "global_batch"):
            if getattr(self, name) < 1:
                raise PlanError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.reduce_dtype == DType.FP8:
            raise PlanError("reduce_dtype fp8: gradients are reduced in fp32 or a 16-bit dtype, "
                            "float8 is for the linear layers' GEMMs; set reduce_dtype fp32")
        if self.dtype != DType.FP8 and self.fp8_scaling != Fp8Scaling.TENSORWISE:
            raise PlanError(f"fp8_scaling '{self.fp8_scaling}' applies to dtype fp8, not "
                            f"'{self.dtype}'; set dtype fp8 or leave fp8_scaling out")
        if self.global_batch != self.dp * self.micro_batch * self.num_microbatches:
            raise PlanError(f"global_batch {self.global_batch} != dp {self.dp} x micro_batch "
                            f"{self.micro_batch} x num_microbatches {self.num_microbatches} = "
                            f"{self.dp * self.micro_batch * self.num_microbatches}")
        if self.cp > 1 and self.seq_len % (2 * self.cp):
            raise PlanError(
                f"cp {self.cp} needs seq_len {self.seq_len} to split into 2 x cp = {2 * self.cp} "
                f"equal chunks (causal load balancing); choose a cp with 2 cp dividing seq_len")
        if self.weight_prediction != "none" and self.schedule != Schedule.ASYNC:
            raise PlanError(f"weight_prediction '{self.weight_prediction}' applies only to "
                            f"schedule 'async', not '{self.schedule}'; set schedule 'async' or "
                            f"weight_prediction 'none'")
        fixed = self.schedule.info.chunks_per_rank
        if fixed == 2 and self.vpp != 2:
            raise PlanError(f"schedule {self.schedule} places two chunks per rank in a V: set "
                            f"vpp 2, not {self.vpp}")
        if fixed == 1 and self.vpp > 1:
            raise PlanError(f"vpp {self.vpp} > 1 needs schedule 'interleaved', not '{self.schedule}'")
        if self.tp == 1:  # nothing to split: both switches mean nothing
            object.__setattr__(self, "sequence_parallel", False)
            object.__setattr__(self, "tp_comm_overlap", False)
        if self.tp_comm_overlap and not self.sequence_parallel:
            raise PlanError(f"tp_comm_overlap overlaps sequence parallelism's all-gathers and "
                            f"reduce-scatters with the GEMMs: set sequence_parallel true with "
                            f"tp {self.tp}, or tp_comm_overlap false")
        if self.stages and len(self.stages) != self.pp * self.vpp:
            raise PlanError(f"{len(self.stages)} stages listed for pp {self.pp} x vpp {self.vpp} "
                            f"= {self.pp * self.vpp} model chunks")
        self._check_layer_strategies()

    def _check_layer_strategies(self) -> None:
        if self.cp > 1 and any(stage.layer_strategies for stage in self.stages):
            raise PlanError(f"cp {self.cp} with per-layer strategies: layerwise plans split "
                            f"the stage's devices by tp and dp only; use cp 1 or drop the "
                            f"layer strategies")
        for index, stage in enumerate(self.stages):
            for offset, strategy in enumerate(stage.layer_strategies or ()):
                where = f"stage {index} layer {stage.start + offset}"
                if strategy.tp * strategy.dp != self.tp * self.dp:
                    raise PlanError(f"{where}: tp {strategy.tp} x dp {strategy.dp} != the stage's "
                                    f"{self.tp * self.dp} devices (plan tp x dp); split the "
                                    f"stage's devices exactly")
                if (self.dp * self.micro_batch) % strategy.dp:
                    raise PlanError(f"{where}: dp {strategy.dp} does not divide the "
                                    f"{self.dp * self.micro_batch} sequences of a micro-batch "
                                    f"(plan dp x micro_batch); choose a dp that divides them")

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    def degrees(self) -> str:
        """``tp T x pp P x dp D`` (`` x cp C`` when context parallel): the world's factors."""
        return f"tp {self.tp} x pp {self.pp} x dp {self.dp}" + \
            (f" x cp {self.cp}" if self.cp > 1 else "")

    @property
    def grad_replicas(self) -> int:
        """Ranks holding the same parameters (dp x cp): gradients are reduced, and ZeRO shards
        its state, over this group."""
        return self.dp * self.cp

    @property
    def num_chunks(self) -> int:
        return self.pp * self.vpp

    def rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int, cp_rank: int = 0) -> int:
        return ((pp_rank * self.dp + dp_rank) * self.cp + cp_rank) * self.tp + tp_rank

    def coords_of(self, rank: int) -> tuple[int, int, int, int]:
        """(pp_rank, dp_rank, cp_rank, tp_rank) of a global rank (``rank_of`` inverted)."""
        if not 0 <= rank < self.world_size:
            raise PlanError(f"rank {rank} is outside the plan's {self.world_size} ranks")
        rest, tp_rank = divmod(rank, self.tp)
        rest, cp_rank = divmod(rest, self.cp)
        pp_rank, dp_rank = divmod(rest, self.dp)
        return pp_rank, dp_rank, cp_rank, tp_rank

    def chunks_of(self, pp_rank: int) -> list[int]:
        """Model chunks held by one pipeline rank: looped (c % pp), or a V for zbv/dualpipev."""
        if self.schedule.v_shape:
            return [pp_rank, 2 * self.pp - 1 - pp_rank]
        return list(range(pp_rank, self.num_chunks, self.pp))

    def pp_rank_of_chunk(self, chunk: int) -> int:
        """The pipeline rank holding model chunk ``chunk`` (``chunks_of`` inverted)."""
        if self.schedule.v_shape and chunk >= self.pp:
            return 2 * self.pp - 1 - chunk
        return chunk % self.pp

    def recompute_of_layer(self) -> list[Recompute]:
        return [mode for stage in self.stages for mode in stage.recompute]

    def check_against(self, model: ModelSpec, world_size: int | None = None) -> None:
        """Refuse a plan this model or world cannot run; the message names the mismatch."""
        if world_size is not None and self.world_size != world_size:
            raise PlanError(f"{self.degrees()} = {self.world_size} ranks, but the job has "
                            f"{world_size}; change a degree or the number of processes")
        if not self.stages:
            raise PlanError("the plan lists no stages; use with_even_stages() or plan it")
        expected = 0
        for index, stage in enumerate(self.stages):
            if stage.start != expected:
                raise PlanError(f"stage {index} starts at layer {stage.start}, expected {expected}")
            expected = stage.stop
            for offset, mode in enumerate(stage.recompute):
                layer = model.layers[min(stage.start + offset, model.num_layers - 1)]
                if mode not in layer.activation:
                    raise PlanError(f"layer {layer.name} cannot use recompute '{mode}' "
                                    f"(supported: {', '.join(layer.activation)})")
        if expected != model.num_layers:
            raise PlanError(f"the stages cover layers [0, {expected}) but model {model.name} has "
                            f"{model.num_layers} layers (embedding + {model.num_blocks} blocks + "
                            "head)")
        if self.tp > 1 and not model.tp_splittable:
            raise PlanError(f"model {model.name} cannot be split by tensor parallelism; use tp 1")
        layer_tps = sorted({x.tp for st in self.stages for x in st.layer_strategies or ()} - {1})
        for tp, whose, way in [(self.tp, "tp", "a tp that divides it")] * (self.tp > 1) + [
                (t, "a layer strategy's tp", "layer tp degrees that divide it") for t in layer_tps]:
            for what, value in (("num_heads", model.num_heads), ("num_kv_heads", model.num_kv_heads),
                                ("ffn_hidden_size", model.ffn_hidden_size)):
                if value % tp or not model.tp_splittable:
                    raise PlanError(f"{whose} {tp} does not divide {what} {value} of "
                                    f"{model.name}; choose {way}")
        if self.cp > 1 and model.arch == "custom":
            raise PlanError(f"cp {self.cp}: model {model.name} is a traced module whose attention "
                            f"meshmorph cannot split over the sequence; use cp 1")
        if self.sequence_parallel and self.seq_len % self.tp:
            raise PlanError(f"sequence parallel needs tp {self.tp} to divide seq_len {self.seq_len}")
        if self.sequence_parallel and self.cp > 1 and (self.seq_len // self.cp) % self.tp:
            raise PlanError(f"sequence parallel needs tp {self.tp} to divide the "
                            f"{self.seq_len // self.cp} tokens each of cp {self.cp} ranks holds; "
                            f"choose a tp or cp that divides them, or turn sequence parallel off")
        self.check_microbatches()

    def check_microbatches(self) -> None:
        """Refuse a micro-batch count the schedule cannot run with this pp (the schedule table)."""
        info = self.schedule.info
        least = info.min_microbatches_per_pp * self.pp
        if self.pp > 1 and self.num_microbatches < least:
            per = "" if info.min_microbatches_per_pp == 1 else f"{info.min_microbatches_per_pp} x "
            raise PlanError(f"schedule {self.schedule} needs num_microbatches >= {per}pp = "
                            f"{least}, got {self.num_microbatches}; raise the batch or use "
                            f"{'zbv' if self.schedule.v_shape else 'gpipe'}")
        if self.pp > 1 and info.microbatches_multiple_of_pp and self.num_microbatches % self.pp:
            raise PlanError(f"{self.schedule} needs num_microbatches ({self.num_microbatches}) to "
                            f"be a multiple of pp ({self.pp})")

    def with_even_stages(self, model: ModelSpec,
                         recompute: Recompute = Recompute.NONE) -> Plan:
        """The same plan with the blocks split as evenly as possible over the model chunks
        (earlier chunks take the extra block), the embedding joining the first chunk and the head
        the last, as Megatron-LM splits; ``recompute`` applies to every block."""
        chunks, blocks = self.num_chunks, model.num_layers - 2
        if blocks < chunks:
            raise PlanError(f"{blocks} blocks cannot fill {chunks} pipeline chunks; lower pp or vpp")
        base, extra = divmod(blocks, chunks)
        stages, start = [], 0
        for index in range(chunks):
            stop = start + base + (index < extra) + (index == 0) + (index == chunks - 1)
            modes = tuple(recompute if recompute in model.layers[i].activation else Recompute.NONE
                          for i in range(start, stop))
            stages.append(StagePlan(start=start, stop=stop, recompute=modes))
            start = stop
        return replace(self, stages=tuple(stages))

    # --- JSON -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "stages"}
        data["schedule"] = str(self.schedule)
        data["dtype"], data["reduce_dtype"] = str(self.dtype), str(self.reduce_dtype)
        if self.dtype == DType.FP8:
            data["fp8_scaling"] = str(self.fp8_scaling)
        else:
            del data["fp8_scaling"]
        data["world_size"] = self.world_size
        data["stages"] = [
            {"layers": [s.start, s.stop], "recompute": [str(m) for m in s.recompute], "gpu": s.gpu}
            | ({"layer_strategies": [x.to_dict() for x in s.layer_strategies]}
               if s.layer_strategies is not None else {})
            for s in self.stages
        ]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known - {"world_size", "search_time_s"}
        if unknown:
            raise PlanError(f"plan has unknown keys: {', '.join(sorted(unknown))}")
        kwargs = {k: v for k, v in data.items() if k in known and k != "stages"}
        listed = data.get("stages", [])
        if not isinstance(listed, list) or not all(isinstance(s, dict) for s in listed):
            raise PlanError(f"'stages' must be a list of objects "
                            f'{{"layers": [start, stop], "recompute": [...]}}, got '
                            f"{type(listed).__name__} {str(listed)[:60]}; leave it out to split "
                            f"the layers evenly")
        stages = tuple(StagePlan(start=int(s["layers"][0]), stop=int(s["layers"][1]),
                                 recompute=tuple(Recompute(m) for m in s["recompute"]),
                                 gpu=s.get("gpu"), layer_strategies=s.get("layer_strategies"))
                       for s in listed)
        plan = cls(**kwargs, stages=stages)
        if "world_size" in data and data["world_size"] != plan.world_size:
            raise PlanError(f"plan says world_size {data['world_size']} but tp x pp x dp"
                            f"{' x cp' if plan.cp > 1 else ''} = {plan.world_size}")
        return plan

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """``load_plan``: the plan in a file (the best one of a ``meshmorph plan --json`` file)."""
        return load_plan(path)


_INTEGERS = ("seq_len", "global_batch", "tp", "pp", "dp", "cp", "zero", "micro_batch",
             "num_microbatches", "vpp", "world_size")
_WAY_OUT = ("write it with 'meshmorph plan --json' or 'meshmorph estimate --json', or fix it by "
            f"hand (keys: {', '.join(f.name for f in fields(Plan) if f.name != 'predicted')})")


def load_plan(path: str | Path) -> Plan:
    """The plan in ``path`` (the best one of a ``meshmorph plan --json`` file). Every way the file
    can be wrong (empty, binary, not an object, values of the wrong type) is one PlanError, not a
    TypeError or KeyError from deep inside."""
    path = Path(path)
    if path.is_dir():
        raise PlanError(f"plan file {path} is a folder; pass the path of a plan JSON file")
    if not path.is_file():
        raise PlanError(f"plan file {path} does not exist; {_WAY_OUT}")
    data = read_document(path, what="plan file", way_out=_WAY_OUT, fmt="json", error=PlanError)
    if "plans" in data:  # `meshmorph plan --json`: the best plan first
        plans = data["plans"]
        if not isinstance(plans, list) or not plans:
            raise PlanError(f"plan file {path} lists no plans under 'plans'; {_WAY_OUT}")
        data = plans[0]
    if not isinstance(data, dict):
        raise PlanError(f"plan file {path} must hold a JSON object in 'plans', got "
                        f"{type(data).__name__}; {_WAY_OUT}")
    for key in _INTEGERS:
        if key in data and (not isinstance(data[key], int) or isinstance(data[key], bool)):
            raise PlanError(f"plan file {path}: {key} must be an integer, got {data[key]!r}")
    try:
        return Plan.from_dict(data)
    except PlanError as exc:
        raise PlanError(f"plan file {path}: {exc}") from None
    except (TypeError, KeyError, IndexError, AttributeError, ValueError) as exc:
        what = f"missing key {exc}" if isinstance(exc, KeyError) else str(exc)
        raise PlanError(f"plan file {path} does not hold a valid plan ({what}); {_WAY_OUT}") from None
