"""A whole training run on transient nodes, as a discrete-event simulation (simpy).

Each node is a simpy process: it is requested, starts, lives until the hazard revokes it (or the
provider's cap stops it) and is then replaced. The training process computes in segments between
checkpoints at the planner's step time; a revocation interrupts it. What is lost and what a
recovery costs depends on the strategy:

- ``on-demand``: nodes are never revoked (on-demand prices).
- ``restart``: the job stops; the lost node's replacement VM starts (CM-DARE's measured start-up),
  training restarts cold and reloads the last checkpoint. Work since that checkpoint is lost,
  unless the provider's notice is long enough to write a checkpoint first.
- ``reshape``: the job continues on the survivors after a warm restart, a re-plan and moving the
  lost node's share of the state (from the checkpoint); the replacement arrives after CM-DARE's
  server request delay and the job grows back with another move (no work lost).

Every node is billed from the moment it runs to its end. Checkpoints are written every
``sqrt(2 * write_s * MTBF)`` seconds (Young/Daly) unless the interval is given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import simpy

from meshmorph.predict.overheads import Overheads
from meshmorph.predict.revocation import Hazard
from meshmorph.predict.training_job import TrainingJob

STRATEGIES = ("restart", "reshape", "on-demand")


@dataclass(slots=True, kw_only=True)
class SimulationConfig:
    """How one simulated run is set up."""

    strategy: str = "restart"
    """``restart``, ``reshape`` or ``on-demand``."""
    checkpoint_interval_s: float | None = None
    """Seconds of training between checkpoints; None: Young/Daly from the hazard."""
    max_checkpoint_interval_s: float = 4 * 3600.0
    """Upper bound of the Young/Daly interval (and the interval without revocations)."""
    revocations_s: tuple[tuple[int, float], ...] | None = None
    """Fixed revocations ``(node, time_s)`` instead of drawn ones (for hand-checked cases)."""

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.strategy!r}; use one of {', '.join(STRATEGIES)}")


@dataclass(slots=True)
class RunResult:
    """One simulated run."""

    time_s: float
    """Wall time from the first request to the last step."""
    cost_usd: float
    """Node-seconds held times the price."""
    revocations: int
    """Nodes revoked (including stops at the provider's cap)."""
    lost_steps: float
    """Steps computed and then lost."""
    timeline: list[tuple[float, float, str, int]] = field(default_factory=list)
    """``(start_s, end_s, kind, nodes)``: kind is start, compute, checkpoint, recover or wait."""


class _Run:
    def __init__(self, job: TrainingJob, hazard: Hazard, overheads: Overheads,
                 config: SimulationConfig, rng: np.random.Generator) -> None:
        self.job, self.hazard, self.overheads, self.config, self.rng = job, hazard, overheads, config, rng
        self.env = simpy.Environment()
        self.up = 0
        self.held_node_s = 0.0
        self.changed = self.env.event()
        self.trainer: simpy.Process | None = None
        self.running: dict[int, float] = {}  # node -> when it started running
        self.result = RunResult(0.0, 0.0, 0, 0.0)
        self.fixed = sorted(config.revocations_s or ())

    def write_s(self, nodes: int) -> float:
        return self.overheads.checkpoint_write_s(self.job.checkpoint_bytes, nodes)

    def interval_s(self, nodes: int) -> float:
        if self.config.checkpoint_interval_s is not None:
            return self.config.checkpoint_interval_s
        rate = 0.0 if self.config.strategy == "on-demand" else self.hazard.mean_rate_per_h()
        if rate <= 0:
            return self.config.max_checkpoint_interval_s
        mtbf_s = 3600.0 / (rate * self.job.nodes)
        return min(self.config.max_checkpoint_interval_s, math.sqrt(2 * self.write_s(nodes) * mtbf_s))

    def lifetime_s(self, node: int) -> float:
        if self.config.strategy == "on-demand":
            return math.inf
        if self.config.revocations_s is not None:
            for index, (who, at) in enumerate(self.fixed):
                if who == node and at >= self.env.now:
                    del self.fixed[index]
                    return at - self.env.now
            return math.inf
        return self.hazard.sample_h(self.rng) * 3600.0

    def signal(self) -> None:
        self.changed.succeed()
        self.changed = self.env.event()

    def node(self, index: int, first_delay_s: float):  # type: ignore[no-untyped-def]
        delay = first_delay_s
        while True:
            yield self.env.timeout(delay)
            started = self.env.now  # billed from the moment it runs
            self.running[index] = started
            self.up += 1
            self.signal()
            life = self.lifetime_s(index)
            done = self.env.event() if math.isinf(life) else self.env.timeout(life)
            yield done | self.finished
            if self.finished.triggered:
                return
            self.held_node_s += self.env.now - started
            del self.running[index]
            self.up -= 1
            self.result.revocations += 1
            if self.trainer is not None and self.trainer.is_alive:
                self.trainer.interrupt("revoked")
            delay = (self.overheads.replacement_s(self.rng) if self.config.strategy == "reshape"
                     else self.overheads.vm_start_s_draw(self.rng))

    def log(self, start: float, kind: str, nodes: int) -> None:
        if self.env.now > start:
            self.result.timeline.append((start, self.env.now, kind, nodes))

    def train(self):  # type: ignore[no-untyped-def]
        job, reshape = self.job, self.config.strategy == "reshape"
        done = saved = 0.0
        need_start, first = True, True
        phase, start, step, nodes = "wait", 0.0, 1.0, 0
        while done < job.total_steps:
            try:
                if reshape and not need_start and self.up != nodes:
                    need_start = True  # nodes came back while the job wrote or recovered: grow
                nodes = self.up if reshape else job.nodes
                enough = self.up >= (1 if reshape else job.nodes)
                step = job.step_time_s(nodes) if enough else None
                if step is None:  # wait for nodes (no plan fits the survivors)
                    phase, start = "wait", self.env.now
                    yield self.changed
                    self.log(start, "start" if first else "wait", self.up)
                    continue
                if need_start:  # (re)start training on ``nodes`` nodes and load the state
                    phase, start = "recover", self.env.now
                    yield self.env.timeout(self.overheads.recover_s(
                        first=first, reshape=reshape, state_bytes=job.checkpoint_bytes,
                        nodes=nodes, rng=self.rng))
                    self.log(start, "recover", nodes)
                    done, need_start, first = saved, False, False
                to_checkpoint = max(1.0, math.ceil(self.interval_s(nodes) / step))
                steps = min(to_checkpoint, job.total_steps - done)
                phase, start = "compute", self.env.now
                grow = self.changed if reshape and nodes < job.nodes else self.env.event()
                outcome = yield self.env.timeout(steps * step) | grow
                self.log(start, "compute", nodes)
                if grow in outcome:  # a replacement arrived: keep the work, reshape to grow
                    done += (self.env.now - start) / step
                    saved, need_start = done, True
                    continue
                done += steps
                if done < job.total_steps:
                    phase, start = "checkpoint", self.env.now
                    yield self.env.timeout(self.write_s(nodes))
                    self.log(start, "checkpoint", nodes)
                    saved = done
            except simpy.Interrupt:
                self.log(start, phase, nodes)
                progress = saved
                if phase == "compute":
                    progress = done + (self.env.now - start) / step
                elif phase == "checkpoint":
                    progress = done
                keep = saved
                if phase in ("compute", "checkpoint") and self.hazard.notice_s >= self.write_s(nodes):
                    # the notice covers an emergency checkpoint: only the notice window is lost
                    keep = max(saved, progress - self.hazard.notice_s / step)
                self.result.lost_steps += progress - keep
                done = saved = keep
                need_start = True
        self.result.time_s = self.env.now
        self.finished.succeed()

    def run(self) -> RunResult:
        self.finished = self.env.event()
        start_s = self.overheads.vm_start_s_draw(self.rng)
        for index in range(self.job.nodes):
            self.env.process(self.node(index, start_s))
        self.trainer = self.env.process(self.train())
        self.env.run(until=self.finished)
        self.held_node_s += sum(self.env.now - started for started in self.running.values())
        self.result.cost_usd = self.held_node_s * self.job.node_price_per_s
        return self.result


def simulate_run(job: TrainingJob, hazard: Hazard, overheads: Overheads,
                 config: SimulationConfig, seed: int = 0) -> RunResult:
    """One run of ``job`` under ``config`` with revocations drawn from ``hazard``."""
    return _Run(job, hazard, overheads, config, np.random.default_rng(seed)).run()


def summarize(runs: list[RunResult]) -> dict[str, float]:
    """P50/P90 of time (hours) and cost over runs, and mean revocations and lost steps."""
    hours = np.array([r.time_s / 3600 for r in runs])
    cost = np.array([r.cost_usd for r in runs])
    return {"runs": len(runs),
            "time_h_p50": float(np.percentile(hours, 50)), "time_h_p90": float(np.percentile(hours, 90)),
            "cost_usd_p50": float(np.percentile(cost, 50)), "cost_usd_p90": float(np.percentile(cost, 90)),
            "revocations_mean": float(np.mean([r.revocations for r in runs])),
            "lost_steps_mean": float(np.mean([r.lost_steps for r in runs]))}
