"""Pipeline stages and schedules from ``torch.distributed.pipelining``.

Chunk ``c`` of ``plan.stages`` runs on pipeline rank ``plan.pp_rank_of_chunk(c)``: ``c % pp``
(Megatron's interleaved order), or a V under zbv and dualpipev. Schedules:

- ``gpipe``: ScheduleGPipe; ``1f1b``: Schedule1F1B (needs m >= pp);
- ``interleaved``: ScheduleInterleaved1F1B over the ``vpp`` chunks each rank holds;
- ``async`` does not come here: ``meshmorph run`` hands it to ``run/async_pipe/train.py`` (no flush,
  one chunk per rank, its own executor);
- ``zb``: ScheduleInterleavedZeroBubble (ZB-H1, Qi et al. 2023) with one chunk per rank. It splits
  each backward into the input-gradient part (B), which the previous stage waits for, and the
  weight-gradient part (W), which fills the bubble;
- ``zbv``: ScheduleZBVZeroBubble, ``dualpipev``: ScheduleDualPipeV, each rank holding chunks
  ``r`` and ``2 pp - 1 - r`` (the V), which both need.

Stage shapes are given up front (no shape-inference round trip): a chunk with the embedding takes
tokens [b, s]; other chunks take the hidden state [b, s/t or s, h] (sliced by sequence under
sequence parallelism); the last chunk returns logits [b, s, V].
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as pipelining_schedules
from torch.distributed.pipelining.schedules import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    FULL_BACKWARD,
    PipelineScheduleSingle,
    _Action,
    _PipelineSchedule,
    _PipelineScheduleRuntime,
)

from meshmorph.run.parallel.mesh import TrainMesh
from meshmorph.run.parallel.parallelize import TORCH_DTYPES, uses_fsdp_precision
from meshmorph.schedule import schedule_actions
from meshmorph.schedule.trace import TRACE_ENV, timeline_events, write_trace
from meshmorph.spec.model import ModelSpec
from meshmorph.spec.plan import Plan


def io_dtypes(plan: Plan) -> tuple[torch.dtype, torch.dtype]:
    """(hidden state, logits) dtypes between stages: fp32 plans send fp32; under autocast the
    residual stream stays fp32 and the head's logits come out 16-bit; under FSDP2's mixed
    precision (zero 2/3) the whole chunk computes in the 16-bit dtype."""
    if plan.dtype == "fp32":
        return torch.float32, torch.float32
    compute = TORCH_DTYPES[plan.dtype]
    return (compute if uses_fsdp_precision(plan) else torch.float32), compute


def _io_shapes(chunk_index: int, plan: Plan, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Meta tensors of one micro-batch's input and output of a chunk (dtypes: ``io_dtypes``)."""
    b, s, h = plan.micro_batch, plan.seq_len, spec.hidden_size
    local_s = s // plan.tp if plan.sequence_parallel else s
    hidden_dtype, logits_dtype = io_dtypes(plan)
    # requires_grad marks the tensors whose gradients travel back between stages
    hidden = torch.empty(b, local_s, h, dtype=hidden_dtype, device="meta", requires_grad=True)
    first, last = chunk_index == 0, chunk_index == plan.num_chunks - 1
    inputs = torch.empty(b, s, dtype=torch.long, device="meta") if first else hidden
    outputs = torch.empty(b, s, spec.vocab_size, dtype=logits_dtype, device="meta",
                          requires_grad=True) \
        if last else hidden
    return inputs, outputs


class ActionRecorder:
    """Times every action this rank's pipeline stages run: forward (F), full backward (B),
    input-gradient backward (I) and weight gradient (W), as (kind, stage, micro-batch, start_s,
    end_s) from ``start()`` (call it right after a barrier so that the ranks' clocks agree)."""

    def __init__(self) -> None:
        self.records: list[tuple[str, int, int, float, float]] = []
        self.origin_s: float | None = None

    def start(self) -> None:
        self.records, self.origin_s = [], time.perf_counter()

    def stop(self) -> list[tuple[str, int, int, float, float]]:
        self.origin_s = None
        return self.records

    def wrap(self, stage: PipelineStage) -> None:
        """Time ``stage``'s forward_one_chunk, backward_one_chunk, backward_weight_one_chunk."""
        index = stage.stage_index

        def timed(method: Callable[..., Any], kind_of: Callable[[dict[str, Any]], str]
                  ) -> Callable[..., Any]:
            def run(chunk_id: int, *args: Any, **kwargs: Any) -> Any:
                if self.origin_s is None:
                    return method(chunk_id, *args, **kwargs)
                start = time.perf_counter()
                out = method(chunk_id, *args, **kwargs)
                end = time.perf_counter()
                self.records.append((kind_of(kwargs), index, int(chunk_id),
                                     start - self.origin_s, end - self.origin_s))
                return out
            return run

        stage.forward_one_chunk = timed(stage.forward_one_chunk, lambda kw: "F")
        stage.backward_one_chunk = timed(stage.backward_one_chunk,
                                         lambda kw: "B" if kw.get("full_backward", True) else "I")
        stage.backward_weight_one_chunk = timed(stage.backward_weight_one_chunk, lambda kw: "W")


class RunTrace:
    """``meshmorph run --trace N``: times every pipeline action of the run's steps 2 to N + 1
    (step 1 warms up) on every rank and writes ``RUN_DIR/trace.json`` from rank 0, in the format
    of ``meshmorph timeline --trace`` (``meshmorph.schedule.trace``), one row per pipeline rank."""

    def __init__(self, recorder: ActionRecorder, plan: Plan, path: Path, steps: int,
                 steps_left: int) -> None:
        self.recorder, self.plan, self.path = recorder, plan, path
        self.first = 2 if steps_left >= 2 else 1
        self.last = min(steps_left, self.first + steps - 1)
        self.done = 0

    @classmethod
    def from_env(cls, schedule: object, plan: Plan, out_dir: Path, steps_left: int
                 ) -> RunTrace | None:
        """The trace the environment asks for, or None (no --trace, or no pipeline to time)."""
        steps = int(os.environ.get(TRACE_ENV) or 0)
        recorder = getattr(schedule, "meshmorph_recorder", None)
        if steps < 1 or steps_left < 1:
            return None
        if recorder is None:
            if dist.get_rank() == 0:
                print("--trace: this plan has no pipeline (pp 1), so there is no pipeline "
                      "timeline to record", flush=True)
            return None
        return cls(recorder, plan, out_dir / "trace.json", steps, steps_left)

    def before_step(self) -> None:
        if self.done + 1 == self.first:
            dist.barrier()  # the ranks' clocks start together
            self.recorder.start()

    def after_step(self) -> None:
        self.done += 1
        if self.done != self.last:
            return
        records = self.recorder.stop()
        gathered: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
        dist.gather_object(records, gathered if dist.get_rank() == 0 else None, dst=0)
        if dist.get_rank() != 0:
            return
        ops, seen = [], set()
        for records_of_rank in gathered:  # the lowest global rank of each pipeline rank
            pp_ranks = {self.plan.pp_rank_of_chunk(stage) for _, stage, *_ in records_of_rank}
            if not records_of_rank or pp_ranks & seen:
                continue
            seen |= pp_ranks
            ops += [(self.plan.pp_rank_of_chunk(stage), kind, stage, mb, start, end)
                    for kind, stage, mb, start, end in records_of_rank]
        steps = self.last - self.first + 1
        write_trace(self.path, timeline_events(sorted(ops, key=lambda op: op[4])),
                    schedule=str(self.plan.schedule), pp=self.plan.pp,
                    microbatches=self.plan.num_microbatches, vpp=self.plan.vpp, steps=steps)
        print(f"trace of steps {self.first}-{self.last}: {self.path} ({len(ops)} actions); "
              f"compare it with 'meshmorph timeline --compare {self.path.parent}'", flush=True)


def action_list_schedule(stages: list[PipelineStage], name: str, m: int,
                         loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                         ) -> _PipelineSchedule:
    """Run meshmorph's own action lists (``meshmorph.schedule``, looped placement) through torch
    pipelining's runtime for action lists (sends and receives added by torch)."""
    kinds = {"F": FORWARD, "B": FULL_BACKWARD, "I": BACKWARD_INPUT, "W": BACKWARD_WEIGHT}
    p = stages[0].group_size
    orders = schedule_actions(name, p, m, len(stages))
    runtime = _PipelineScheduleRuntime(stages, m, loss_fn=loss_fn)
    runtime._prepare_schedule_with_comms(
        {r: [_Action(a.stage, kinds[str(a.kind)], a.microbatch) for a in order]
         for r, order in enumerate(orders)})
    return runtime


def build_schedule(chunks: list[nn.Module], chunk_ids: list[int], spec: ModelSpec, plan: Plan,
                   mesh: TrainMesh, device: torch.device,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *,
                   scale_grads: bool = True) -> _PipelineSchedule:
    """The schedule that runs this rank's ``chunks`` (model chunks ``chunk_ids``) each step.

    ``loss_fn`` returns a micro-batch's loss. ``scale_grads``: the schedule divides the gradients
    by the number of micro-batches at the step's end (``loss_fn`` then returns the mean); off,
    ``loss_fn`` carries the division itself."""
    group = mesh.group("pp")
    stages = []
    for chunk, index in zip(chunks, chunk_ids, strict=True):
        inputs, outputs = _io_shapes(index, plan, spec)
        stages.append(PipelineStage(chunk, index, plan.num_chunks, device, input_args=inputs,
                                    output_args=outputs, group=group))
    m = plan.num_microbatches
    schedule = _torch_schedule(stages, plan, m, loss_fn)
    schedule.scale_grads = scale_grads
    if os.environ.get(TRACE_ENV):  # meshmorph run --trace: time every action
        recorder = ActionRecorder()
        for stage in stages:
            recorder.wrap(stage)
        schedule.meshmorph_recorder = recorder  # type: ignore[attr-defined]
    return schedule


def _torch_schedule(stages: list[PipelineStage], plan: Plan, m: int,
                    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                    ) -> _PipelineSchedule:
    """The torch.distributed.pipelining schedule the table names for the plan's schedule: a
    single-stage class takes this rank's one stage, the others the list of its chunks."""
    name = plan.schedule.info.torch_class
    if name is None:
        raise ValueError(f"schedule {plan.schedule} runs in meshmorph's own executor, not torch's "
                         "pipelining (run/async_pipe/)")
    cls = getattr(pipelining_schedules, name)
    single = issubclass(cls, PipelineScheduleSingle)
    return cls(stages[0] if single else stages, m, loss_fn=loss_fn)
