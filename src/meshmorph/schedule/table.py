"""The one schedule table: every pipeline schedule meshmorph plans, prices, draws and runs.

``Schedule`` is the closed set of names (``Plan.schedule`` is one of them, equal to its JSON
string); ``Schedule.info`` is the row of the table that says everything else about a schedule:
how its model chunks sit on the pipeline ranks, whether it splits the backward, whether it
flushes, the fewest micro-batches it runs, and the ``torch.distributed.pipelining`` class that
runs it. Nothing else in meshmorph spells a schedule's name or restates one of these facts.

This module imports nothing of meshmorph, so ``spec/`` (the Plan) can read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Schedule(StrEnum):
    """A pipeline schedule, by the name a Plan's JSON and the CLI use."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    ZERO_BUBBLE = "zb"  # ZB-H1 (Qi et al. 2023): backward split into input and weight gradients
    ZBV = "zbv"  # zero-bubble V (Qi et al. 2023): rank r holds chunks r and 2pp - 1 - r
    DUALPIPEV = "dualpipev"  # DeepSeek's DualPipe folded into a V: the same placement
    ASYNC = "async"  # 1F1B without flush, a step per micro-batch (PipeDream): run/async_pipe/

    @property
    def info(self) -> ScheduleInfo:
        """This schedule's row of the table."""
        return TABLE[self]

    @property
    def v_shape(self) -> bool:
        """Two chunks per rank in a V: rank r holds chunks r and 2 pp - 1 - r."""
        return TABLE[self].v_shape

    @property
    def split_backward(self) -> bool:
        """The backward is split into input-gradient (I) and weight-gradient (W) passes."""
        return TABLE[self].split_backward


@dataclass(frozen=True, slots=True)
class ScheduleInfo:
    """One row of the schedule table."""

    title: str
    """What it is, for help texts and tables."""
    chunks_per_rank: int | None
    """Model chunks each pipeline rank holds: a fixed number (1, or 2 for a V), or None when the
    plan's ``vpp`` chooses it (interleaved)."""
    v_shape: bool = False
    """Chunks placed in a V (rank r: r and 2 pp - 1 - r) instead of looped (chunk c on c mod pp)."""
    split_backward: bool = False
    """Backward split into input- and weight-gradient passes (zero-bubble family)."""
    flush: bool = True
    """The step ends with every micro-batch's backward done (False: asynchronous, no flush)."""
    min_microbatches_per_pp: int = 0
    """With pp > 1 the schedule needs at least this many micro-batches per pipeline rank (0: any)."""
    microbatches_multiple_of_pp: bool = False
    """With pp > 1 the micro-batch count must be a multiple of pp (Megatron's interleaving)."""
    torch_class: str | None = None
    """The ``torch.distributed.pipelining`` schedule class that runs it (None: meshmorph's own
    executor runs it)."""

    def vpp_for(self, vpp: int) -> int:
        """The chunks per rank a plan with ``vpp`` has under this schedule."""
        return vpp if self.chunks_per_rank is None else self.chunks_per_rank


TABLE: dict[Schedule, ScheduleInfo] = {
    Schedule.GPIPE: ScheduleInfo("GPipe: all forwards, then all backwards", 1,
                                 torch_class="ScheduleGPipe"),
    Schedule.ONE_F_ONE_B: ScheduleInfo("1F1B (PipeDream-Flush)", 1, min_microbatches_per_pp=1,
                                       torch_class="Schedule1F1B"),
    Schedule.INTERLEAVED: ScheduleInfo("interleaved 1F1B over vpp looped chunks", None,
                                       min_microbatches_per_pp=1, microbatches_multiple_of_pp=True,
                                       torch_class="ScheduleInterleaved1F1B"),
    Schedule.ZERO_BUBBLE: ScheduleInfo("ZB-H1: 1F1B with the weight gradients deferred", 1,
                                       split_backward=True, min_microbatches_per_pp=1,
                                       torch_class="ScheduleInterleavedZeroBubble"),
    Schedule.ZBV: ScheduleInfo("zero-bubble V: two chunks per rank in a V", 2, v_shape=True,
                               split_backward=True, torch_class="ScheduleZBVZeroBubble"),
    Schedule.DUALPIPEV: ScheduleInfo("DualPipeV: DualPipe folded into a V", 2, v_shape=True,
                                     split_backward=True, min_microbatches_per_pp=2,
                                     torch_class="ScheduleDualPipeV"),
    Schedule.ASYNC: ScheduleInfo("asynchronous 1F1B without flush (PipeDream)", 1, flush=False,
                                 min_microbatches_per_pp=1),
}
