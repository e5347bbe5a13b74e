"""The zones a run may use: each zone's capacity process, VM lifetime and prices, from the packaged
measurements, the cloud catalog, a user's catalog file or a recorded trace, with a sentence
wherever one GPU's, zone's or region's data stands in for another's."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from meshmorph.predict.availability import ZoneAvailability, fit_trace
from meshmorph.predict.cloud_catalog import CloudCatalog, Provider, UserZone
from meshmorph.predict.fits import rate_fit
from meshmorph.predict.revocation import Hazard
from meshmorph.predict.spot_data import (
    PreemptionMode,
    availability_for,
    default_mode,
    lifetimes_for,
    zone_hazard,
)
from meshmorph.predict.traces import SpotTrace, ZoneTrace
from meshmorph.spec.gpus import gpu as gpu_spec

USER_TICK_S = 60.0
"""Tick on which a user zone's capacity figures are drawn."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Zone:
    """One zone as the simulator sees it."""

    name: str
    """Zone name (``any`` where the provider has no zone data)."""
    availability: ZoneAvailability | None
    """Its capacity process; None: capacity is always there (no data)."""
    lifetime: Hazard
    """A running VM's lifetime (lifetime mode; in capacity mode only the provider's cap)."""
    spot_node_usd_per_h: float
    """Spot price of one node (``gpus_per_node`` GPUs) per hour."""
    on_demand_node_usd_per_h: float
    """On-demand price of one node per hour."""
    price_note: str = ""
    """Date and source of the prices."""
    trace: ZoneTrace | None = None
    """The recorded capacity replayed in this zone (``--trace``), if any."""

    @property
    def share(self) -> float:
        """Long-run share of time with capacity."""
        return 1.0 if self.availability is None else self.availability.share

    @property
    def cost_per_useful_hour(self) -> float:
        """Spot price over the share of time with capacity: the ranking of ``--zones auto``."""
        return self.spot_node_usd_per_h / max(self.share, 1e-6)


@dataclass(frozen=True, slots=True, kw_only=True)
class MarketRequest:
    """What the market is built for."""

    gpu: str
    """GPU catalog key."""
    gpus_per_node: int
    """GPUs per node (one VM)."""
    provider: str
    """Catalog provider (``gcp-spot``)."""
    zones: tuple[str, ...] = ()
    """Zones to use; empty: every zone with data (``--zones auto``)."""
    mode: PreemptionMode | None = None
    """What ends a running VM; None: the GPU's default (``spot_data.default_mode``)."""
    trace: SpotTrace | None = None
    """A recorded trace whose zones replace the fitted ones (``--trace``)."""
    spot_gpu_usd_per_h: float | None = None
    """A spot price per GPU-hour that replaces the catalog's (a cluster file's)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Market:
    """The zones of one run, ranked, and what stands in for what."""

    gpu: str
    """GPU catalog key."""
    provider: Provider
    """The offering's rules."""
    mode: PreemptionMode
    """What ends a running VM."""
    zones: tuple[Zone, ...]
    """Zones, cheapest per useful hour first."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    """Which data stands in where, and why."""
    availability_source: str = ""
    """The capacity data used (set name or trace)."""
    lifetime_source: str = ""
    """The VM lifetime data used."""
    replay_tick_s: float = 0.0
    """Seconds per tick of the replayable trace (0: none)."""

    def zone(self, name: str) -> Zone:
        return next(z for z in self.zones if z.name == name)


USER_WEIGHT = 10**6
"""A user's figures are taken as exact: fitted as if from this many periods (no interval)."""


def user_availability(zone: UserZone) -> ZoneAvailability:
    """A user zone's figures as geometric up and down runs on a one-minute tick."""
    up_ticks = zone.mean_up_h * 3600 / USER_TICK_S
    down_ticks = up_ticks * (1 - zone.share_available) / zone.share_available
    never = math.isinf(up_ticks) or zone.share_available == 1.0
    n = USER_WEIGHT
    return ZoneAvailability(
        zone=zone.name, observed_share=1.0 if never else zone.share_available,
        up=rate_fit(0 if never else n, 1.0 if never else n * up_ticks, USER_TICK_S, zone.source),
        down=rate_fit(n, n * max(down_ticks, 1.0), USER_TICK_S, zone.source),
        source=zone.source or "user zone")


def _availability(request: MarketRequest, catalog: CloudCatalog, provider: Provider
                  ) -> tuple[dict[str, ZoneAvailability | None], list[str], str]:
    """Capacity per zone (trace, packaged data, user zones) with notes and the source's name."""
    notes: list[str] = []
    if request.trace is not None:
        zones: dict[str, ZoneAvailability | None] = dict(fit_trace(request.trace))
        source = f"trace {request.trace.name} (replayed; the model beside it is fitted to it)"
    else:
        data, note = availability_for(request.gpu, provider.cloud)
        zones = dict(data.availability) if data else {}
        notes += [note] if note else []
        source = data.key if data else "none"
    users = {z.name: user_availability(z) for z in catalog.zones.values()
             if z.provider == provider.name and z.gpu in ("", request.gpu)}
    if users and not zones:  # the user's zones are all there is: no stand-in to report
        notes, source = [], "your zones"
    zones.update(users)
    if not zones:
        zones = {"any": None}
    return zones, notes, source


def _lifetime(request: MarketRequest, catalog: CloudCatalog, provider: Provider,
              mode: PreemptionMode, zone: str) -> tuple[Hazard, str, str]:
    """(hazard, note, source) of a running VM in ``zone``."""
    user = catalog.zones.get(zone)
    if mode is PreemptionMode.CAPACITY:
        never = Hazard.constant("capacity", source="capacity")
        return provider.rules(never) if provider.hazard else never, "", "capacity"
    if user is not None and user.preemptions_per_h is not None:
        hazard = Hazard.constant(zone, user.preemptions_per_h, source=user.source)
        return provider.rules(hazard) if provider.hazard else hazard, "", "user zone"
    data, note = lifetimes_for(request.gpu, provider.cloud)
    if data is None or not provider.hazard:
        never = Hazard.constant("none", source="none")
        return provider.rules(never), note if provider.hazard and not user else "", provider.name
    hazard, zone_note = zone_hazard(data, zone)
    return provider.rules(hazard), note, data.key + (" (pooled)" if zone_note else "")


def _prices(request: MarketRequest, catalog: CloudCatalog, provider: Provider, name: str,
            trace: ZoneTrace | None) -> tuple[float, float, str]:
    """(spot, on-demand) per node-hour and where they come from."""
    n = request.gpus_per_node
    instance = catalog.instance_for(request.gpu, n, provider.cloud)
    spot = od = None
    note = ""
    if instance is not None:
        price = catalog.price(instance, name)
        spot, od = price.spot_usd_per_h, price.on_demand_usd_per_h
        note = f"{instance.name} {price.region}, {price.date}: {price.source}"
        own = price.region != instance.region or (instance.name, instance.region) in \
            catalog.prices
        if trace is not None and trace.spot_usd_per_h is not None and not own:
            spot, od = trace.spot_usd_per_h, trace.on_demand_usd_per_h or od
            note = f"the trace's own prices ({trace.price_date or 'undated'})"
    catalog_gpu = gpu_spec(request.gpu)
    if spot is None and catalog_gpu.spot_price_per_hour is not None:
        spot, note = catalog_gpu.spot_price_per_hour * n, f"GPU catalog ({catalog_gpu.price_date})"
    if od is None and catalog_gpu.price_per_hour is not None:
        od = catalog_gpu.price_per_hour * n
    if request.spot_gpu_usd_per_h is not None:
        spot, note = request.spot_gpu_usd_per_h * n, "the cluster file's price"
    if spot is None or od is None:
        kind = "spot" if spot is None else "on-demand"
        raise ValueError(f"no {kind} price for {n} x {request.gpu} on {provider.name} in {name}; "
                         "add an instance and a [[prices]] entry with --catalog FILE "
                         "(examples/my_zones.toml), or set price_per_gpu_hour in a cluster file")
    return spot, od, note


def build_market(request: MarketRequest, catalog: CloudCatalog) -> Market:
    """Every zone the request may use, with its capacity, VM lifetime and prices."""
    provider = catalog.provider(request.provider)
    mode = request.mode or default_mode(request.gpu, provider.cloud)
    found, notes, availability_source = _availability(request, catalog, provider)
    if request.zones:
        unknown = [z for z in request.zones if z not in found]
        if unknown:
            raise ValueError(f"unknown zone {', '.join(unknown)} for {request.gpu} on "
                             f"{provider.name}; known: {', '.join(sorted(found))} (or add one "
                             "under [[zones]] in a --catalog file)")
        found = {z: found[z] for z in request.zones}
    zones, sources = [], set()
    for name, availability in found.items():
        hazard, note, source = _lifetime(request, catalog, provider, mode, name)
        notes += [note] if note and note not in notes else []
        sources.add(source)
        trace = request.trace.zones.get(name) if request.trace else None
        spot, od, price_note = _prices(request, catalog, provider, name, trace)
        zones.append(Zone(name=name, availability=availability, lifetime=hazard,
                          spot_node_usd_per_h=spot, on_demand_node_usd_per_h=od,
                          price_note=price_note, trace=trace))
    if mode is PreemptionMode.CAPACITY:
        stand_in, _ = lifetimes_for(request.gpu, provider.cloud)
        notes.append(f"preemption: a node is lost when its zone's capacity goes (the traces' "
                     f"convention; no {request.gpu} VM lifetimes were measured on "
                     f"{provider.cloud}: --preemption lifetime uses "
                     f"{stand_in.key if stand_in else 'none'} instead)")
    ranked = sorted(zones, key=lambda z: (z.cost_per_useful_hour, z.name))
    return Market(gpu=request.gpu, provider=provider, mode=mode, zones=tuple(ranked),
                  notes=tuple(notes), availability_source=availability_source,
                  lifetime_source=", ".join(sorted(sources)),
                  replay_tick_s=request.trace.tick_s if request.trace else 0.0)
