"""A whole training run on spot nodes across zones, as a discrete-event simulation (simpy).

Each zone's capacity follows a path drawn from its fitted process (``availability.py``) or, with
``replay``, its recorded trace from one start tick shared by every zone. Each node is a process:
it waits for capacity, starts (CM-DARE's measured VM start-up) and runs until preempted (capacity
mode: its zone's capacity goes; lifetime mode: its drawn lifetime or the provider's cap ends),
then waits again unless the policy released it. On-demand nodes are never preempted. A node is
billed at its zone's price while it runs.

The trainer checkpoints every ``sqrt(2 write_s MTBF)`` (Young/Daly, at most 4 h) at the planner's
step time for its node count. A preemption loses the steps since the last checkpoint, or only the
notice window where the notice covers a checkpoint write; then the policy decides (``policy.py``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import simpy

from meshmorph.predict.availability import ZonePath, drawn_periods, replayed_periods
from meshmorph.predict.market import Market, Zone
from meshmorph.predict.overheads import Overheads
from meshmorph.predict.policy import ON_DEMAND, SINGLE_ZONE, DeadlineBound, Policy, choose_zone
from meshmorph.predict.reshape_cost import reshape_move
from meshmorph.predict.spot_data import PreemptionMode
from meshmorph.predict.training_job import TrainingJob

RUNNING, STARTING, WAITING = "running", "starting", "waiting"


@dataclass(slots=True, kw_only=True)
class SimulationConfig:
    """How one simulated run is set up."""

    policy: Policy = Policy.RESTART
    """What the run does when capacity comes and goes (``policy.py``)."""
    deadline_h: float | None = None
    """Hours from the first request; the ``deadline`` policy needs it."""
    replay: bool = False
    """Zones' capacity from their recorded traces (``Zone.trace``) instead of the fits."""
    trace_offset_ticks: int | None = None
    """Replay from this tick of the traces; None: drawn from the run's seed."""
    checkpoint_interval_s: float | None = None
    """Seconds of training between checkpoints; None: Young/Daly from the zone's processes."""
    max_checkpoint_interval_s: float = 4 * 3600.0
    """Upper bound of the Young/Daly interval (and the interval without preemptions)."""
    horizon_h: float = 24 * 120.0
    """A run not finished by then stops there (``RunResult.finished`` False)."""
    revocations_s: tuple[tuple[int, float], ...] | None = None
    """Lifetime mode: fixed preemptions ``(node, time_s)`` instead of drawn ones (hand checks)."""

    def __post_init__(self) -> None:
        self.policy = Policy(self.policy)
        if self.policy is Policy.DEADLINE and self.deadline_h is None:
            raise ValueError("the deadline policy needs a deadline; give --deadline HOURS")


@dataclass(slots=True)
class RunResult:
    """One simulated run."""

    time_s: float = 0.0
    """Wall time from the first request to the last step."""
    cost_usd: float = 0.0
    """Node-seconds held times their prices."""
    preemptions: int = 0
    """Nodes preempted (including stops at the provider's cap)."""
    lost_steps: float = 0.0
    """Steps computed and then lost."""
    finished: bool = True
    """False where the horizon came first."""
    zone_compute_s: dict[str, float] = field(default_factory=dict)
    """Seconds of training per zone (``on-demand`` for on-demand nodes)."""
    moves: int = 0
    """Changes of zone (multi-zone, deadline)."""
    reshapes: int = 0
    """Continuations on survivors and grow-backs (reshape)."""
    switched_at_s: float | None = None
    """When the deadline policy left spot (None: it did not)."""
    timeline: list[tuple[float, float, str, int, str]] = field(default_factory=list)
    """``(start_s, end_s, kind, nodes, where)``: start, compute, checkpoint, recover or wait."""


@dataclass(slots=True, eq=False)
class _Node:
    index: int
    zone: str
    state: str = WAITING
    started_s: float = 0.0
    released: bool = False
    stop: Any = None


class _Run:
    def __init__(self, job: TrainingJob, market: Market, overheads: Overheads,
                 config: SimulationConfig, rng: np.random.Generator) -> None:
        self.job, self.market, self.overheads, self.config, self.rng = \
            job, market, overheads, config, rng
        self.env = simpy.Environment()
        self.result = RunResult()
        self.nodes: list[_Node] = []
        self.changed = self.env.event()
        self.finished = self.env.event()
        self.current: str | None = None
        self.switched = config.policy is Policy.ON_DEMAND
        self.done = self.saved = 0.0
        self.zones = {z.name: z for z in market.zones}
        self.fixed = sorted(config.revocations_s or ())
        self.od_zone = market.zones[0].name
        self.offset = config.trace_offset_ticks
        used = market.zones[:1] if config.policy in SINGLE_ZONE else market.zones
        self.paths = {z.name: self._path(z) for z in used} if not self.switched else {}
        self.bound = self._deadline_bound()

    # ---- zones and their paths ----
    def _path(self, zone: Zone) -> ZonePath:
        if self.config.replay:
            if zone.trace is None:
                raise ValueError(f"zone {zone.name} has no recorded trace to replay; give "
                                 "--trace FILE with that zone, or simulate from the fits")
            if self.offset is None:  # one start tick for every zone (they stay aligned)
                self.offset = int(self.rng.integers(len(zone.trace.states)))
            return ZonePath(replayed_periods(zone.trace.states, self.market.replay_tick_s,
                                             self.offset))
        if zone.availability is None:
            return ZonePath(iter([(True, math.inf)]))
        periods, start = drawn_periods(zone.availability, self.rng)
        return ZonePath(periods, start)

    def up(self, zone: str) -> bool:
        return zone == ON_DEMAND or self.paths[zone].up(self.env.now)

    def _zone_process(self, zone: str):  # type: ignore[no-untyped-def]
        path = self.paths[zone]
        while True:
            change = path.next_change_s(self.env.now)
            if math.isinf(change):
                return
            yield self.env.timeout(max(change - self.env.now, 0.0))
            if not path.up(self.env.now) and self.market.mode is PreemptionMode.CAPACITY:
                for node in self.nodes:
                    if node.zone == zone and node.state in (RUNNING, STARTING):
                        self._stop(node, "capacity")
            self._notify()

    def _notify(self) -> None:
        self.changed.succeed()
        self.changed = self.env.event()

    # ---- nodes ----
    def _bill(self, node: _Node) -> None:
        """Charge ``node``'s time since it started running at its zone's price."""
        if node.zone == ON_DEMAND:
            usd_per_h = self.zones.get(self.od_zone, self.market.zones[0]).on_demand_node_usd_per_h
        else:
            usd_per_h = self.zones[node.zone].spot_node_usd_per_h
        self.result.cost_usd += (self.env.now - node.started_s) * (usd_per_h / 3600)

    def _stop(self, node: _Node, why: str) -> None:
        if node.stop is not None and not node.stop.triggered:
            node.stop.succeed(why)

    def _lifetime_s(self, node: _Node) -> float:
        if node.zone == ON_DEMAND:
            return math.inf
        if self.config.revocations_s is not None:
            for index, (who, at) in enumerate(self.fixed):
                if who == node.index and at >= self.env.now:
                    del self.fixed[index]
                    return at - self.env.now
            return math.inf
        return self.zones[node.zone].lifetime.sample_h(self.rng) * 3600

    def _node_life(self, node: _Node):  # type: ignore[no-untyped-def]
        spot = node.zone != ON_DEMAND
        while not node.released:
            if not self.up(node.zone):  # no capacity: wait for it
                yield self.changed
                continue
            node.state, node.stop = STARTING, self.env.event()
            yield self.env.timeout(self.overheads.vm_start_s_draw(self.rng, spot)) | node.stop
            if node.stop.triggered:  # capacity went (or released) while it started
                node.state = WAITING
                continue
            node.state, node.started_s = RUNNING, self.env.now
            self._notify()
            life = self._lifetime_s(node)
            yield (node.stop if math.isinf(life) else self.env.timeout(life) | node.stop)
            self._bill(node)
            node.state = WAITING
            if not node.released and not self.finished.triggered:
                self.result.preemptions += 1
                self._notify()

    def _request(self, target: str) -> None:
        """Hold ``job.nodes`` nodes in ``target``; release the others."""
        if target != self.current:
            if self.current is not None and ON_DEMAND not in (target, self.current):
                self.result.moves += 1
            for node in self.nodes:
                if node.zone != target and not node.released:
                    node.released = True
                    self._stop(node, "released")
            if target == ON_DEMAND and self.current in self.zones:
                self.od_zone = self.current  # on-demand where the job was
            self.current = target
        live = [n for n in self.nodes if n.zone == target and not n.released]
        for _ in range(self.job.nodes - len(live)):
            node = _Node(index=len([n for n in self.nodes if n.zone == target]), zone=target)
            self.nodes.append(node)
            self.env.process(self._node_life(node))

    # ---- the trainer ----
    def _deadline_bound(self) -> DeadlineBound | None:
        if self.config.deadline_h is None:
            return None
        n = self.job.nodes
        return DeadlineBound(
            step_s=float(self.job.step_time_s(n)),  # type: ignore[arg-type]
            start_s=self.overheads.vm_start_max_s(False) + self.overheads.cold_restart_max_s(),
            load_s=self.overheads.load_s(self.job.checkpoint_bytes, n),
            write_s=self.overheads.checkpoint_write_s(self.job.checkpoint_bytes, n),
            interval_s=self.config.checkpoint_interval_s or self.config.max_checkpoint_interval_s)

    def _switch_time_s(self) -> float:
        assert self.bound is not None and self.config.deadline_h is not None
        return self.bound.switch_time_s(self.config.deadline_h * 3600,
                                        self.job.total_steps - self.saved)

    def _deadline_due(self) -> bool:
        return (self.config.policy is Policy.DEADLINE and not self.switched
                and self.env.now >= self._switch_time_s())

    def _target(self) -> str:
        if self._deadline_due():
            self.switched, self.result.switched_at_s = True, self.env.now
        if self.switched:
            return ON_DEMAND
        return choose_zone(self.config.policy, self.market.zones, self.current, self.up)

    def _wake(self) -> simpy.Event:
        if self.config.policy is Policy.DEADLINE and not self.switched:
            return self.changed | self.env.timeout(max(self._switch_time_s() - self.env.now, 0))
        return self.changed

    def _log(self, start: float, kind: str, nodes: int) -> None:
        if self.env.now > start:
            self.result.timeline.append((start, self.env.now, kind, nodes, str(self.current)))
            if kind == "compute":
                zones = self.result.zone_compute_s
                zones[str(self.current)] = zones.get(str(self.current), 0.0) + self.env.now - start

    def _phase(self, kind: str, seconds: float, members: list[_Node], grow: bool = False
               ) -> Generator[Any, Any, str]:
        """Wait ``seconds`` unless a member is lost, the deadline calls, or (``grow``) a spare
        node is up: "done", "lost", "switch" or "grow"; logged on the timeline as ``kind``."""
        start = self.env.now
        end = start + seconds
        while True:
            if any(m.state != RUNNING for m in members):
                why = "lost"
            elif self._deadline_due():
                why = "switch"
            elif self.env.now >= end:
                why = "done"
            elif grow and self._spares(members):
                why = "grow"
            else:
                yield self.env.timeout(end - self.env.now) | self._wake()
                continue
            self._log(start, kind, len(members))
            return why

    def _spares(self, members: list[_Node]) -> list[_Node]:
        return [n for n in self.nodes if n.zone == self.current and n.state == RUNNING
                and n not in members]

    def _gather(self, target: str) -> Generator[Any, Any, list[_Node] | None]:
        """Wait until all the job's nodes run in ``target`` (None: the target changed)."""
        start = self.env.now
        while True:
            running = [n for n in self.nodes if n.zone == target and n.state == RUNNING]
            if len(running) >= self.job.nodes:
                self._log(start, "wait" if self.result.timeline else "start", len(running))
                return running[:self.job.nodes]
            if self._target() != target:
                self._log(start, "wait", len(running))
                return None
            yield self._wake()

    def _write_s(self, nodes: int) -> float:
        return self.overheads.checkpoint_write_s(self.job.checkpoint_bytes, nodes)

    def _interval_s(self, nodes: int) -> float:
        """Young/Daly: sqrt(2 write MTBF), the MTBF of the job's nodes where it runs now."""
        if self.config.checkpoint_interval_s is not None:
            return self.config.checkpoint_interval_s
        rate_per_h, zone = 0.0, self.zones.get(str(self.current))
        if zone is not None and self.market.mode is PreemptionMode.LIFETIME:
            rate_per_h = nodes * zone.lifetime.mean_rate_per_h()
        elif zone is not None and zone.availability is not None:  # capacity: the zone's mean up
            up_h = zone.availability.up.mean_h
            rate_per_h = 1 / up_h if math.isfinite(up_h) else 0.0
        if rate_per_h <= 0:
            return self.config.max_checkpoint_interval_s
        return min(self.config.max_checkpoint_interval_s,
                   math.sqrt(2 * self._write_s(nodes) * 3600 / rate_per_h))

    def _rollback(self, nodes: int, notice: bool) -> None:
        """Back to the last checkpoint, or to the notice window where the notice covers a write."""
        keep = self.saved
        zone = self.zones.get(str(self.current))
        step = self.job.step_time_s(nodes) or 1.0
        if notice and zone is not None and zone.lifetime.notice_s >= self._write_s(nodes):
            keep = max(self.saved, self.done - zone.lifetime.notice_s / step)
        self.result.lost_steps += self.done - keep
        self.done = self.saved = keep

    def _recover(self, members: list[_Node], first: bool) -> Generator[Any, Any, bool]:
        """Cold restart (and the checkpoint read after a stop) on ``members``."""
        seconds = self.overheads.recover_s(first=first, state_bytes=self.job.checkpoint_bytes,
                                           nodes=len(members), rng=self.rng)
        return (yield from self._phase("recover", seconds, members)) == "done"

    def _reshape(self, members: list[_Node], survivors: list[_Node]
                 ) -> Generator[Any, Any, list[_Node] | None]:
        """Continue on ``survivors`` (fewer or more nodes than ``members``): a warm restart and the
        move Reshape prices; None where no plan fits them (the caller stops and restarts)."""
        n, m = len(members), len(survivors)
        move = reshape_move(self.job, n, m)
        if move is None:
            self._rollback(n, notice=True)
            return None
        seconds = self.overheads.warm_restart_s_draw(self.rng) + move.move_s
        if move.from_checkpoint and m < n:  # pieces only the lost node held
            before = self.saved
            self._rollback(n, notice=True)
            if self.saved == before:  # no emergency write: everybody reads the checkpoint
                seconds += self.overheads.load_s(self.job.checkpoint_bytes, m)
        why = yield from self._phase("recover", seconds, survivors)
        if why == "done":
            self.result.reshapes += 1
            return survivors
        if why == "lost":
            alive = [s for s in survivors if s.state == RUNNING]
            return (yield from self._reshape(survivors, alive)) if alive else None
        self._rollback(m, notice=False)
        return None

    def _after(self, why: str, members: list[_Node]) -> Generator[Any, Any, list[_Node] | None]:
        """The members to go on with after an interruption (None: stop and start again)."""
        n = len(members)
        if why == "grow":
            grown = members + self._spares(members)[:self.job.nodes - n]
            return (yield from self._reshape(members, grown))
        alive = [m for m in members if m.state == RUNNING]
        if (why == "lost" and self.config.policy is Policy.RESHAPE and alive
                and self.job.step_time_s(len(alive)) is not None):
            return (yield from self._reshape(members, alive))
        self._rollback(n, notice=why == "lost")
        return None

    def _compute(self, members: list[_Node]) -> Generator[Any, Any, None]:
        """Train on ``members`` in checkpointed segments until done or stopped."""
        total = self.job.total_steps
        while self.done < total:
            n = len(members)
            step = float(self.job.step_time_s(n))  # type: ignore[arg-type]
            every = max(1, math.ceil(self._interval_s(n) / step))
            target = min(self.saved + every, total)
            steps = target - self.done
            grow = self.config.policy is Policy.RESHAPE and n < self.job.nodes
            start = self.env.now
            why = yield from self._phase("compute", steps * step, members, grow)
            self.done = target if why == "done" else \
                self.done + min((self.env.now - start) / step, steps)
            if why == "done" and self.done < total:
                why = yield from self._phase("checkpoint", self._write_s(n), members)
                if why == "done":
                    self.saved = self.done
            if why != "done":
                members = yield from self._after(why, members)
                if members is None:
                    return

    def _train(self):  # type: ignore[no-untyped-def]
        first = True
        while self.done < self.job.total_steps:
            target = self._target()
            self._request(target)
            members = yield from self._gather(target)
            if members is None:
                continue
            if not (yield from self._recover(members, first)):
                self._rollback(len(members), notice=False)
                continue
            first = False
            yield from self._compute(members)
        self.finished.succeed()

    def run(self) -> RunResult:
        for zone in self.paths:
            self.env.process(self._zone_process(zone))
        self.env.process(self._train())
        self.env.run(until=self.finished | self.env.timeout(self.config.horizon_h * 3600))
        self.result.finished = self.finished.triggered
        self.result.time_s = self.env.now
        for node in self.nodes:
            if node.state == RUNNING:
                self._bill(node)
        return self.result


def simulate_run(job: TrainingJob, market: Market, overheads: Overheads,
                 config: SimulationConfig, seed: int = 0) -> RunResult:
    """One run of ``job`` in ``market`` under ``config``, seeded."""
    return _Run(job, market, overheads, config, np.random.default_rng(seed)).run()


def summarize(runs: list[RunResult], deadline_h: float | None = None) -> dict[str, Any]:
    """P10/P50/P90 of time (hours) and cost over runs, means of the events, and the zones used
    (share of the training time in each)."""
    hours = np.array([r.time_s / 3600 for r in runs])
    cost = np.array([r.cost_usd for r in runs])
    zones: Counter[str] = Counter()
    for r in runs:
        zones.update(r.zone_compute_s)
    total = sum(zones.values()) or 1.0
    out: dict[str, Any] = {"runs": len(runs)}
    for p in (10, 50, 90):
        out[f"time_h_p{p}"] = float(np.percentile(hours, p))
        out[f"cost_usd_p{p}"] = float(np.percentile(cost, p))
    out.update({f"{name}_mean": float(np.mean([getattr(r, name) for r in runs]))
                for name in ("preemptions", "lost_steps", "moves", "reshapes")})
    out.update({"unfinished": sum(not r.finished for r in runs),
                "switched_to_on_demand": sum(r.switched_at_s is not None for r in runs),
                "zones": {z: s / total for z, s in zones.most_common()}})
    if deadline_h is not None:
        out["met_deadline"] = float(np.mean(hours <= deadline_h))
    return out
