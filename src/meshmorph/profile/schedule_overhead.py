"""A pipeline schedule's own time: torch's pipelining schedule (GPipe or 1F1B) over the plan's
pipeline ranks with the plan's micro-batch count and hidden-state messages, through stages that
do almost no compute (one scalar multiply).

On CPU processes sharing cores, a pipelined step costs more than its stages' compute and the
bubble: each micro-batch's forward and backward action runs through the schedule's Python
(argument flattening, receive buffers, ``stage_backward``), and every hand-over wakes a process
blocked in a receive. The layer passes (profile/layers.py) time the compute alone, so
``meshmorph validate`` measures this remainder as its own piece, between the plan's steps; the
cost model's transfers on the critical path (two messages per boundary) are inside it too, a
few tenths of a millisecond each on loopback.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from meshmorph.profile.timing import every_rank
from meshmorph.schedule.table import Schedule
from meshmorph.spec.model import ModelSpec
from meshmorph.spec.plan import Plan

SCHEDULES = (Schedule.GPIPE, Schedule.ONE_F_ONE_B)
"""Schedules whose overhead is measured (one stage per rank)."""


class _Scale(nn.Module):
    """A stage of no compute worth timing: x * w, one parameter so that a backward runs."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def measures(plan: Plan, world: int) -> bool:
    """Whether ``ScheduleOverhead`` measures this plan: one stage per rank, the pipeline over
    every rank (pp = world), GPipe or 1F1B."""
    return plan.pp > 1 and plan.pp == world and plan.vpp == 1 and plan.schedule in SCHEDULES


class ScheduleOverhead:
    """The plan's schedule at almost no compute; ``sample()`` runs one step of it (every rank
    at once) and keeps the slowest rank's seconds; ``seconds(window)`` is their median."""

    def __init__(self, model: ModelSpec, plan: Plan, world: int, rank: int, device: torch.device):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        if not measures(plan, world):
            raise ValueError(f"the schedule overhead is measured for gpipe/1f1b plans with pp = "
                             f"world ({world}), got pp {plan.pp}, schedule {plan.schedule}")
        b, s, h = plan.micro_batch, model.seq_len, model.hidden_size
        m = plan.num_microbatches
        self.module = _Scale().to(device)
        hidden = torch.empty(b, s, h, device="meta", requires_grad=True)
        stage = PipelineStage(self.module, rank, world, device, input_args=hidden,
                              output_args=hidden)
        kind = ScheduleGPipe if plan.schedule == Schedule.GPIPE else Schedule1F1B
        self.schedule = kind(stage, m, loss_fn=lambda out, target: out.mean())
        self.args = (torch.randn(m * b, s, h, device=device),) if rank == 0 else ()
        self.target = torch.zeros(m * b, device=device) if rank == world - 1 else None
        self.kept: list[float] = []
        """The slowest rank's seconds of each kept step."""

    def sample(self, *, keep: bool = True) -> None:
        """One step of the schedule after a barrier; kept unless ``keep`` is False."""
        dist.barrier()
        start = time.perf_counter()
        self.schedule.step(*self.args, target=self.target)
        seconds = time.perf_counter() - start
        self.module.zero_grad(set_to_none=True)
        if keep:
            self.kept.append(max(row[0] for row in every_rank([seconds])))

    def seconds(self, window: slice = slice(None)) -> float:
        """Median seconds of the kept steps in ``window``."""
        return statistics.median(self.kept[window])
