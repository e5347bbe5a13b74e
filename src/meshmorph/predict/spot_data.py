"""The packaged spot measurements as fitted processes, and what stands in where a GPU, cloud or zone
has no data of its own.

Availability (per zone, ``availability.py``): GCP H100 (Oct 2025, 13 zones), AWS L4 (Dec 2025, 10
zones), AWS V100 (Feb 2023, 9 zones, from summaries). Lifetimes of VMs that were running
(``fits.py``): GCP A100 and V100 preemptible groups (Dec 2021), AWS V100 and T4 groups (2021),
AWS V100 1-node traces per zone (Apr 2023), the AWS L4 run (Dec 2025), and CM-DARE's GCP
K80/P100/V100 preemptible VMs by age (2019; ``revocation.py``), kept as the only source for those.

A GPU without its own data borrows the set of the same cloud whose GPU generation is nearest,
then the newest; the choice is returned with a sentence that says so and why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from functools import cache
from typing import Any

from meshmorph.predict.availability import ZoneAvailability, fit_trace, summary_zone
from meshmorph.predict.fits import MIN_EVENTS_FOR_SHAPE, Durations, Fit, best_fit, fit_rate
from meshmorph.predict.measurements import measurements, packaged_json
from meshmorph.predict.revocation import (
    Hazard,
    age_bins,
    fitted_hazards,
    hazard_from_fit,
    regional_hazards,
)
from meshmorph.predict.traces import SpotTrace, trace_from_entry

GENERATION = {"k80": 2014, "p100": 2016, "v100": 2017, "t4": 2018, "a100": 2020, "a10g": 2021,
              "h100": 2022, "l4": 2023, "h200": 2024, "mi300x": 2023, "b200": 2025}
"""Launch year of each GPU family: the nearest generation stands in for a GPU without data."""

CMDARE_GPUS = {"k80": "k80", "p100": "p100", "v100": "v100-16g"}
"""CM-DARE's GPUs (``revocation.fitted_hazards`` keys) and their GPU catalog keys."""


class Cloud(StrEnum):
    """Clouds the packaged data know."""

    GCP = "GCP"
    AWS = "AWS"
    AZURE = "Azure"
    OTHER = "other"


class PreemptionMode(StrEnum):
    """What ends a running spot VM in the simulator."""

    CAPACITY = "capacity"
    """When its zone's capacity goes (the traces' convention: a tick without capacity preempts
    the VMs there); the only H100 data are capacity probes."""
    LIFETIME = "lifetime"
    """Each VM's own lifetime, drawn from the hazard fitted to measured VM lifetimes; capacity
    then only decides when a VM can be started."""


def gpu_family(gpu: str) -> str:
    """``a100-80g`` -> ``a100``."""
    return gpu.split("-")[0].lower()


@dataclass(frozen=True, slots=True, kw_only=True)
class DataSet:
    """One packaged measurement: fitted per zone."""

    key: str
    """Name (``h100-gcp-2025-10``)."""
    gpu: str
    """GPU measured (catalog key)."""
    cloud: Cloud
    """Cloud measured."""
    about: str
    """What was measured."""
    source: str
    """Repository, commit and licence."""
    availability: dict[str, ZoneAvailability] = field(default_factory=dict)
    """Capacity process per zone (availability sets)."""
    lifetimes: dict[str, Hazard] = field(default_factory=dict)
    """VM lifetime hazard per zone or region with enough ends (lifetime sets)."""
    pooled: Hazard | None = None
    """VM lifetime hazard over all its zones (lifetime sets)."""
    fits: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Fitted figures with their intervals, per zone and ``pooled`` (for reports)."""
    trace: SpotTrace | None = None
    """The replayable trace behind an availability set."""


def _header(key: str, entry: dict[str, Any]) -> dict[str, Any]:
    """The ``DataSet`` fields every packaged entry states."""
    return {"key": key, "gpu": entry["gpu"], "cloud": Cloud(entry["cloud"]),
            "about": entry["about"], "source": entry["source"]}


def _availability_set(key: str, entry: dict[str, Any]) -> DataSet:
    common = _header(key, entry)
    if entry["kind"] == "summary":
        zones = {z: summary_zone(z, hours=v["duration_h"], share=v["share"],
                                 periods=v["up_periods"], tick_s=195.0, source=key)
                 for z, v in entry["zones"].items()}
        return DataSet(**common, availability=zones)
    trace = trace_from_entry(key, entry)
    return DataSet(**common, availability=fit_trace(trace), trace=trace)


def _fit_of(kind: str, value: Any, label: str) -> Fit:
    if kind in ("group", "summary"):
        return fit_rate(value["events"], value["vm_hours"], label)
    hours, ended = zip(*value, strict=True) if value else ((), ())
    return best_fit(Durations.observed(hours, [bool(e) for e in ended]), label)


def _lifetime_set(key: str, entry: dict[str, Any]) -> DataSet:
    kind, zones = entry["kind"], entry["zones"]
    fits = {z: _fit_of(kind, v, f"{key} {z}") for z, v in zones.items()}
    everything = [x for v in zones.values() for x in v] if kind == "vms" else \
        {n: sum(v[n] for v in zones.values()) for n in ("events", "vm_hours")}
    pooled = _fit_of(kind, everything, f"{key} pooled")
    return DataSet(**_header(key, entry),
                   lifetimes={z: hazard_from_fit(f, f"{key}/{z}") for z, f in fits.items()
                              if f.events >= MIN_EVENTS_FOR_SHAPE},
                   pooled=hazard_from_fit(pooled, f"{key}/pooled"),
                   fits={**{z: f.to_dict() for z, f in fits.items()}, "pooled": pooled.to_dict()})


def _cmdare_set(gpu: str) -> DataSet:
    """CM-DARE's preemptible VMs of ``gpu`` (a ``CMDARE_GPUS`` key) by age (``revocation.py``)."""
    hazard, counts = fitted_hazards()[gpu], measurements()["revocations_by_region"][gpu.upper()]
    return DataSet(
        key=f"{gpu}-gcp-2019", gpu=CMDARE_GPUS[gpu], cloud=Cloud.GCP,
        about=f"CM-DARE: {gpu.upper()} preemptible GCE VMs by hours since start, 4 regions, "
              "2019 (piecewise-constant hazard, 24 h cap)",
        source=measurements()["sources"]["cmdare"],
        lifetimes={r: h for r, h in regional_hazards()[gpu].items()
                   if sum(counts[r]["revocations_by_hour"]) >= MIN_EVENTS_FOR_SHAPE},
        pooled=hazard, fits={"pooled": {"rates_per_h": list(hazard.rates_per_h)}})


@dataclass(frozen=True, slots=True)
class SetInfo:
    """What a packaged set measured, known without fitting it."""

    key: str
    """Set name."""
    gpu: str
    """GPU measured."""
    cloud: Cloud
    """Cloud measured."""
    lifetimes: bool
    """A lifetime set (else an availability set)."""

    @property
    def date(self) -> str:
        return self.key.split("-", 2)[2]


@cache
def set_infos() -> tuple[SetInfo, ...]:
    """Every packaged set, availability and lifetime, by what it measured."""
    raw = packaged_json("spot_data.json")
    out = [SetInfo(k, e["gpu"], Cloud(e["cloud"]), False) for k, e in raw["availability"].items()]
    out += [SetInfo(k, e["gpu"], Cloud(e["cloud"]), True) for k, e in raw["lifetimes"].items()]
    out += [SetInfo(f"{gpu}-gcp-2019", key, Cloud.GCP, True) for gpu, key in CMDARE_GPUS.items()]
    return tuple(out)


@cache
def availability_set(key: str) -> DataSet:
    """A packaged availability set, fitted (once per process)."""
    return _availability_set(key, packaged_json("spot_data.json")["availability"][key])


@cache
def lifetime_set(key: str) -> DataSet:
    """A packaged lifetime set, fitted (once per process)."""
    if key.endswith("-gcp-2019"):
        return _cmdare_set(key.split("-")[0])
    return _lifetime_set(key, packaged_json("spot_data.json")["lifetimes"][key])


def _nearest(gpu: str, cloud: Cloud, lifetimes: bool) -> tuple[DataSet | None, str]:
    """The set for ``gpu`` on ``cloud`` (lifetime or availability sets), or the stand-in."""
    wanted = [s for s in set_infos() if s.lifetimes == lifetimes]
    what = "VM lifetimes" if lifetimes else "capacity (availability)"
    build = lifetime_set if lifetimes else availability_set
    own = [s for s in wanted if s.cloud == cloud and gpu_family(s.gpu) == gpu_family(gpu)]
    if own:
        return build(max(own, key=lambda s: s.date).key), ""
    same_cloud = [s for s in wanted if s.cloud == cloud]
    if not same_cloud:
        return None, (f"no {what} data for {cloud} at all: none stands in (capacity is assumed "
                      "always there and VMs never end; give a zone in a --catalog file)")
    year = GENERATION.get(gpu_family(gpu), 2020)
    best = min(same_cloud, key=lambda s: (abs(GENERATION.get(gpu_family(s.gpu), 2020) - year),
                                          [-ord(c) for c in s.date]))
    return build(best.key), (f"no {what} data for {gpu} on {cloud}: {best.key} stands in (the "
                             f"same cloud's nearest GPU generation, {best.gpu})")


def availability_for(gpu: str, cloud: Cloud) -> tuple[DataSet | None, str]:
    """The availability set for ``gpu`` on ``cloud`` and, where another stands in, why."""
    return _nearest(gpu, cloud, lifetimes=False)


def lifetimes_for(gpu: str, cloud: Cloud) -> tuple[DataSet | None, str]:
    """The lifetime set for ``gpu`` on ``cloud`` and, where another stands in, why."""
    return _nearest(gpu, cloud, lifetimes=True)


def zone_hazard(data: DataSet, zone: str) -> tuple[Hazard, str]:
    """The set's hazard for ``zone`` (its own, its region's, else pooled, with a note)."""
    region = zone.rsplit("-", 1)[0] if zone[-1:].isalpha() and "-" in zone else zone
    for name in (zone, region):
        if name in data.lifetimes:
            return data.lifetimes[name], ""
    assert data.pooled is not None
    return data.pooled, (f"{zone}: no lifetimes of its own in {data.key} (at least "
                         f"{MIN_EVENTS_FOR_SHAPE} ends needed); pooled over its zones")


def default_mode(gpu: str, cloud: Cloud) -> PreemptionMode:
    """Lifetimes where this GPU's VM lifetimes were measured on this cloud; capacity where only
    its capacity was (H100 on GCP); lifetimes (a stand-in) otherwise."""
    family = gpu_family(gpu)
    measured = {(gpu_family(s.gpu), s.lifetimes) for s in set_infos() if s.cloud == cloud}
    if (family, True) in measured or (family, False) not in measured:
        return PreemptionMode.LIFETIME
    return PreemptionMode.CAPACITY


def preemption_rates() -> list[tuple[str, float, float, float]]:
    """(label, rate, low, high) per VM-hour for every lifetime set and zone with a rate."""
    rows = []
    for info in set_infos():
        if not info.lifetimes:
            continue
        if info.key.endswith("-gcp-2019"):  # CM-DARE's first 24 h as one rate
            gpu, data = info.key.split("-")[0].upper(), measurements()
            fit = fit_rate(*age_bins(data["revocations_by_hours_since_start"][gpu],
                                     data["instances_launched"][gpu], (0.0, 24.0))[0], info.key)
            rows.append((info.key, fit.rate_per_h, 1 / fit.scale_ci95[1],
                         1 / fit.scale_ci95[0]))
            continue
        fits = lifetime_set(info.key).fits
        for zone, fit in fits.items():
            if zone == "pooled" and len(fits) == 2:  # one zone: the pooled fit is the same
                continue
            if fit["family"] == "exponential" and fit["events"] > 0:
                mean, (low, high) = fit["mean_h"], fit["mean_ci95_h"]
                rows.append((f"{info.key} {zone}", 1 / mean, 1 / high, 1 / low))
    return rows


def fit_report() -> dict[str, Any]:
    """Every packaged fit with its 95% intervals: capacity per zone, lifetimes per set."""
    availability = {info.key: {z: a.to_dict() for z, a in
                               availability_set(info.key).availability.items()}
                    for info in set_infos() if not info.lifetimes}
    lifetimes = {info.key: lifetime_set(info.key).fits for info in set_infos() if info.lifetimes}
    return {"availability": availability, "lifetimes": lifetimes,
            "preemption_rates_per_vm_h": [
                {"set": label, "rate": rate, "ci95": [low, high]}
                for label, rate, low, high in preemption_rates()]}
