"""The profile pieces one plan's prediction reads, measured between that plan's steps.

On a machine whose load changes (other jobs sharing the cores), a profile taken minutes before
the plans measures another machine: the same micro-batch was seen to take 0.59 s at load 5.4
and 0.11 s at load 1.5. ``meshmorph validate`` therefore measures, for each plan, the pieces
its prediction needs — whole-model layer passes at the plan's micro-batch, the optimizer tail
over chunks of growing size, FSDP2's per-unit gather and reduce-scatter where the plan shards
with FSDP2, the collectives' alpha-beta fits — interleaved with the plan's own steps (pieces,
step, pieces, step, ..., pieces), so both see the same load. The pieces are the profile's own
measurements (profile/layers.py, profile/fsdp_units.py, profile/hardware.py); nothing in them
is read from, or fitted to, the plan's step times.
"""

from __future__ import annotations

import os
import time

import torch

from meshmorph.cost.profile import Profile
from meshmorph.cost.state import fsdp_shards
from meshmorph.profile.alpha_beta import loopback_link
from meshmorph.profile.fsdp_units import FsdpUnits
from meshmorph.profile.hardware import CollectiveSamples
from meshmorph.profile.layers import LayerPasses, OptimizerTails
from meshmorph.profile.schedule_overhead import ScheduleOverhead, measures
from meshmorph.spec.model import ModelSpec, Recompute
from meshmorph.spec.plan import Plan

MESSAGE_BYTES = (4096, 1 << 20, 16 << 20)
"""Message sizes of the collectives sampled between a plan's steps (bytes of comm.py's M)."""
FSDP_UNIT_BLOCKS = 2
"""FSDP2 units of 1..this many blocks are sampled between a plan's steps (two points of a line)."""
TAIL_REPEATS = 3
"""FSDP2 tails (AdamW over DTensor shards) per chunk per sample: the median of several, as their
DTensor dispatch varies more from call to call than a plain tensor's step."""


def block_recompute(model: ModelSpec, plan: Plan) -> Recompute:
    """The recompute mode of the plan's first block (validate's plans use one mode for all)."""
    modes = plan.recompute_of_layer()
    return next(modes[i] for i, layer in enumerate(model.layers) if layer.kind == "block")


class PlanPieces:
    """Samplers of the pieces ``plan`` reads on ``world`` processes; ``sample()`` takes one of
    each (every rank at once), ``profile(window)`` turns the kept samples in ``window`` into a
    Profile: ``window=slice(r, r + 2)`` holds the samples just before and just after the r-th
    timed step when the samples and steps alternate."""

    def __init__(self, model: ModelSpec, plan: Plan, world: int, rank: int, device: torch.device):
        self.world = world
        # compute as the slowest rank did it, collectives as the last rank to reach them
        # saw them: a step that synchronises its ranks waits for the slowest one's compute
        self.layers = LayerPasses(model, plan.micro_batch, plan.dtype, device, slowest=True)
        # the tail as the plan runs it: FSDP2's DTensor shards (plans whose dp group is the
        # whole world)
        fsdp = fsdp_shards(zero=plan.zero, dp=plan.dp) and plan.dp == world
        self.tails = OptimizerTails(model, device, slowest=True, zero=plan.zero,
                                    shard_over=world if plan.dp == world else 1,
                                    repeats=TAIL_REPEATS if fsdp else 1)
        # FSDP2's units are measured over all ranks: plans whose dp group is the whole world
        self.fsdp = FsdpUnits(model, world, device, dtype=plan.dtype,
                              reduce_dtype=plan.reduce_dtype, max_blocks=FSDP_UNIT_BLOCKS,
                              last_arrival=True, micro_batch=plan.micro_batch,
                              recompute=block_recompute(model, plan),
                              prefetch=plan.fsdp_prefetch) if fsdp else None
        self.collectives = CollectiveSamples(list(MESSAGE_BYTES), world, rank, device,
                                             last_arrival=True) if world > 1 else None
        self.schedule = ScheduleOverhead(model, plan, world, rank, device) \
            if measures(plan, world) else None
        """The pipeline schedule's own time at almost no compute (profile/schedule_overhead.py)."""
        self.passes = max(1, round(plan.num_microbatches / plan.pp))
        """Whole-model passes per sample, back to back: as much compute as one rank's step
        (m micro-batches over 1/pp of the layers), so that both get the same share of the cores."""
        self.seconds: list[float] = []
        """Wall seconds of each kept sample (all pieces)."""

    def sample(self, *, keep: bool = True) -> None:
        """One layer pass, one optimizer tail per chunk, one call of every collective per size
        and, where the plan uses FSDP2, one gather and reduce-scatter per unit size."""
        start = time.perf_counter()
        self.layers.sample(keep=keep, passes=self.passes)
        self.tails.sample(keep=keep)
        if self.collectives is not None:
            self.collectives.sample(keep=keep)
        if self.fsdp is not None:
            self.fsdp.sample(keep=keep)
        if self.schedule is not None:
            self.schedule.sample(keep=keep)
        if keep:
            self.seconds.append(time.perf_counter() - start)

    def overhead_s(self, window: slice = slice(None)) -> float:
        """The schedule's own seconds per step in ``window`` (0 without a pipeline)."""
        return self.schedule.seconds(window) if self.schedule is not None else 0.0

    def profile(self, window: slice = slice(None), *, source: str, load_avg: float) -> Profile:
        """The Profile of the kept samples in ``window``; on CPU the whole group's all-reduce
        fit is also the ``loopback`` link (as ``meshmorph profile`` writes it)."""
        fits = self.collectives.fits(window) if self.collectives is not None else {}
        if self.fsdp is not None:
            fits.update(self.fsdp.fits(window))
        bandwidth, latency = ({}, {}) if torch.cuda.is_available() \
            else loopback_link(fits, self.world)
        fixed, per_param = self.tails.fit(window)
        return Profile(link_bandwidth_gbps=bandwidth, link_latency_us=latency, source=source,
                       collectives=fits, layer_times=self.layers.times(window),
                       optimizer_s_per_param=per_param, optimizer_fixed_s=fixed,
                       processes=self.world, cores=os.cpu_count() or 0, load_avg=load_avg)
