"""Whether spot capacity can be had in a zone: an alternating process of periods with capacity
("up") and without ("down": the wait for it), each a run-length distribution on the probes' tick
grid (``fits.py``), and the path of one zone over a simulated run (``ZonePath``).

A zone's series says per tick whether a spot request there succeeded (count series: whether at
least one GPU launched, as the traces' authors count it); runs cut by the data's ends or gaps are
censored.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from meshmorph.predict.fits import RunFit, Runs, fit_runs, rate_fit, runs_of
from meshmorph.predict.traces import SpotTrace

WARM_UP_CYCLES = 30
"""A drawn path starts this many mean up+down cycles before time 0."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ZoneAvailability:
    """The fitted capacity process of one zone for one GPU type."""

    zone: str
    """Zone name (``us-central1-a``)."""
    up: RunFit
    """How long capacity lasts once there."""
    down: RunFit
    """How long a zone stays without capacity: the wait for it."""
    observed_share: float
    """Share of the data's ticks with capacity."""
    at_least: dict[int, float] = field(default_factory=dict)
    """Count series: share of rounds in which at least N GPUs launched, by N."""
    source: str = ""
    """The data it was fitted to (or what stands in for it, and why)."""

    @property
    def share(self) -> float:
        """Long-run share of time with capacity: E[up] / (E[up] + E[down])."""
        if self.observed_share in (0.0, 1.0):
            return self.observed_share
        return 1.0 if math.isinf(self.up.mean_h) else _share(self.up.mean_h, self.down.mean_h)

    @property
    def share_ci95(self) -> tuple[float, float]:
        """95% interval of ``share`` (the means' intervals paired at opposite ends)."""
        if self.observed_share in (0.0, 1.0):
            return self.observed_share, self.observed_share
        (up_lo, up_hi), (down_lo, down_hi) = self.up.mean_ci95_h, self.down.mean_ci95_h
        return _share(up_lo, down_hi), _share(up_hi, down_lo)

    def to_dict(self) -> dict[str, object]:
        return {"zone": self.zone, "share": self.share, "share_ci95": self.share_ci95,
                "observed_share": self.observed_share, "up": self.up.to_dict(),
                "down": self.down.to_dict(), "at_least": self.at_least, "source": self.source}


def _share(up: float, down: float) -> float:
    """up / (up + down) of mean periods that may be infinite (both infinite: undefined)."""
    if math.isinf(up):
        return 1.0 if math.isfinite(down) else math.nan
    return 0.0 if math.isinf(down) else up / (up + down)


def period_runs(segments: Sequence[Sequence[bool]]) -> tuple[Runs, Runs]:
    """(up, down) runs of every segment (runs at segment ends censored)."""
    runs = {True: Runs((), ()), False: Runs((), ())}
    for segment in segments:
        for state, ticks, complete in runs_of(segment):
            runs[state] += Runs((ticks,), (complete,))
    return runs[True], runs[False]


def fit_zone(zone: str, segments: Sequence[Sequence[bool]], tick_s: float, source: str,
             counts: Sequence[int] | None = None) -> ZoneAvailability:
    """Fit the up and down periods of one zone's probe series (``segments`` split at gaps)."""
    up, down = period_runs(segments)
    ticks = [state for segment in segments for state in segment]
    if not ticks:
        raise ValueError(f"zone {zone}: no probe ticks to fit; give a series with at least one")
    at_least = {}
    if counts:
        at_least = {n: float(np.mean([c >= n for c in counts])) for n in (1, 2, 4, 8, 16)}
    return ZoneAvailability(zone=zone, up=_fit_or_never(up, tick_s, f"{source}: {zone} up"),
                            down=_fit_or_never(down, tick_s, f"{source}: {zone} down"),
                            observed_share=float(np.mean(ticks)), at_least=at_least,
                            source=source)


def fit_trace(trace: SpotTrace) -> dict[str, ZoneAvailability]:
    """Every zone of a recorded trace, fitted (``fit_zone``; the trace's name is the source)."""
    return {z: fit_zone(z, t.segments(), trace.tick_s, trace.name, t.counts)
            for z, t in trace.zones.items()}


def _fit_or_never(runs: Runs, tick_s: float, source: str) -> RunFit:
    if not runs.ticks:  # never in this state (the share says so; the fit is never drawn)
        return rate_fit(0, 1.0, tick_s, source)
    return fit_runs(runs, tick_s, source)


def summary_zone(zone: str, *, hours: float, share: float, periods: int, tick_s: float,
                 source: str) -> ZoneAvailability:
    """Geometric up and down runs from a summary: ``periods`` up->down changes in ``hours`` of
    which ``share`` had capacity (end probability = changes / ticks in the state)."""
    ticks = hours * 3600 / tick_s
    return ZoneAvailability(zone=zone, observed_share=share, source=source,
                            up=rate_fit(periods, share * ticks, tick_s, f"{source}: {zone} up"),
                            down=rate_fit(periods, (1 - share) * ticks, tick_s,
                                          f"{source}: {zone} down"))


@dataclass(slots=True)
class ZonePath:
    """When one zone has capacity during one run: state at time 0 and the change times (s),
    extended on demand from a generator of ``(state, seconds)`` periods."""

    periods: Iterator[tuple[bool, float]]
    """Consecutive periods, the first one covering time 0 from ``start_s``."""
    start_s: float = 0.0
    """Where the first period starts (<= 0)."""
    states: list[bool] = field(default_factory=list)
    """State of each known period."""
    ends_s: list[float] = field(default_factory=list)
    """End of each known period, seconds."""

    def _extend(self, until_s: float) -> None:
        while not self.ends_s or self.ends_s[-1] <= until_s:
            state, seconds = next(self.periods)
            end = (self.ends_s[-1] if self.ends_s else self.start_s) + seconds
            if self.states and self.states[-1] == state:
                self.ends_s[-1] = end
            else:
                self.states.append(state)
                self.ends_s.append(end)

    def up(self, time_s: float) -> bool:
        """Whether the zone has capacity at ``time_s``."""
        self._extend(time_s)
        return self.states[bisect.bisect_right(self.ends_s, time_s)]

    def next_change_s(self, time_s: float) -> float:
        """The first change after ``time_s`` (inf when the state never changes again)."""
        self._extend(time_s)
        return self.ends_s[bisect.bisect_right(self.ends_s, time_s)]


def drawn_periods(zone: ZoneAvailability, rng: np.random.Generator
                  ) -> tuple[Iterator[tuple[bool, float]], float]:
    """(periods, start) of a path drawn from the fits, starting up ``WARM_UP_CYCLES`` mean cycles
    before time 0 (so that time 0 falls where the long-run alternation puts it)."""
    cycle_s = (zone.up.mean_ticks * zone.up.tick_s + zone.down.mean_ticks * zone.down.tick_s)
    start = -WARM_UP_CYCLES * cycle_s if math.isfinite(cycle_s) else 0.0

    def periods() -> Iterator[tuple[bool, float]]:
        if zone.observed_share in (0.0, 1.0):  # never (or always) had capacity in the data
            while True:
                yield zone.observed_share == 1.0, math.inf
        state = True
        while True:
            yield state, (zone.up if state else zone.down).sample_s(rng)
            state = not state

    return periods(), start


def replayed_periods(states: Sequence[bool], tick_s: float, offset: int
                     ) -> Iterator[tuple[bool, float]]:
    """The recorded ticks from ``offset`` on, cyclically (the path starts at the tick)."""
    for state in itertools.islice(itertools.cycle(states), offset % len(states), None):
        yield bool(state), tick_s
