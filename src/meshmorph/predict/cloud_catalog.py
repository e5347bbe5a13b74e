"""The cloud catalog: providers' transient rules, instance types, dated spot and on-demand prices per
region, and zones a user describes, from ``data/cloud_catalog.toml`` and an optional user TOML of
the same form (``examples/my_zones.toml``)."""

from __future__ import annotations

import math
import tomllib
from dataclasses import MISSING, dataclass, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any

from meshmorph.files import read_document
from meshmorph.predict.revocation import Hazard
from meshmorph.predict.spot_data import Cloud
from meshmorph.spec.gpus import GPU_CATALOG, LINKS

HAZARDS = ("fitted", "")
"""``fitted``: the packaged measurements; empty: the constant ``rate_per_h``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Provider:
    """A transient (or on-demand) offering's rules."""

    name: str
    """Catalog key (``gcp-spot``)."""
    cloud: Cloud = Cloud.OTHER
    """Whose measurements apply (GCP, AWS, Azure, other)."""
    notice_s: float
    """Warning before a preemption, seconds."""
    max_runtime_h: float | None = None
    """The provider stops a VM at this age; None: no cap."""
    hazard: str = ""
    """``fitted``: lifetimes from the packaged data; empty: the constant ``rate_per_h``."""
    rate_per_h: float = 0.0
    """Constant preemptions per VM-hour (when ``hazard`` is empty)."""
    source: str = ""
    """Where the rules come from."""

    def __post_init__(self) -> None:
        if self.max_runtime_h is not None and not self.max_runtime_h > 0:
            raise ValueError(f"provider {self.name}: max_runtime_h must be > 0 hours, got "
                             f"{self.max_runtime_h}; leave it out for no cap")
        if self.hazard not in HAZARDS:
            raise ValueError(f"provider {self.name}: unknown hazard {self.hazard!r}; use 'fitted' "
                             "or leave it out and give rate_per_h")

    def rules(self, hazard: Hazard) -> Hazard:
        """``hazard`` with this provider's notice and cap (and its constant rate, if it has one)."""
        if not self.hazard:
            hazard = Hazard.constant(f"{self.name} constant", self.rate_per_h,
                                     source=f"{self.name}: rate_per_h")
        return replace(hazard, notice_s=self.notice_s, max_runtime_h=self.max_runtime_h)


@dataclass(frozen=True, slots=True, kw_only=True)
class InstanceType:
    """One rentable VM shape with its default prices."""

    name: str
    """Catalog key (``gcp-h100-x8``)."""
    cloud: str
    """GCP, AWS, Azure."""
    provider: str
    """Its transient offering (a ``Provider`` key)."""
    gpu: str
    """GPU catalog key."""
    gpus: int
    """GPUs per instance."""
    interconnect: str
    """Link between its GPUs (a LINKS key)."""
    network: str
    """Link between instances (a LINKS key)."""
    on_demand_usd_per_h: float | None
    """On-demand price per instance-hour; None: not published."""
    spot_usd_per_h: float | None
    """Spot/preemptible price per instance-hour; None: not published."""
    region: str
    """Region or zone the default price applies to."""
    date: str
    """When the price was read."""
    source: str
    """Where the price comes from."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Price:
    """An instance's prices in one region or zone, dated."""

    instance: str
    """Instance type (an ``InstanceType`` key)."""
    region: str
    """Region (``us-central1``) or zone (``us-east-1a``)."""
    spot_usd_per_h: float | None = None
    """Spot price per instance-hour."""
    on_demand_usd_per_h: float | None = None
    """On-demand price per instance-hour."""
    date: str
    """When it was read."""
    source: str
    """Where it comes from."""


@dataclass(frozen=True, slots=True, kw_only=True)
class UserZone:
    """A zone described by its user: capacity and lifetimes as figures, not data."""

    name: str
    """Zone name."""
    provider: str
    """Offering it belongs to (a ``Provider`` key)."""
    region: str = ""
    """Region whose prices apply (default: the name less its last ``-x``)."""
    gpu: str = ""
    """GPU the figures are for (empty: any)."""
    share_available: float = 1.0
    """Long-run share of time with spot capacity (0-1]."""
    mean_up_h: float = math.inf
    """How long capacity lasts on average, hours (inf: it never goes)."""
    preemptions_per_h: float | None = None
    """Per-VM preemption rate (lifetime mode); None: the provider's (fitted or its rate)."""
    source: str = ""
    """Where the figures come from."""

    def __post_init__(self) -> None:
        if not 0 < self.share_available <= 1:
            raise ValueError(f"zone {self.name}: share_available must be in (0, 1], got "
                             f"{self.share_available}")
        if not self.mean_up_h > 0:
            raise ValueError(f"zone {self.name}: mean_up_h must be > 0 hours, got "
                             f"{self.mean_up_h}; leave it out if capacity never goes")


@dataclass(frozen=True, slots=True)
class CloudCatalog:
    """Providers, instance types, prices and user zones."""

    providers: dict[str, Provider]
    """Offerings by key."""
    instances: dict[str, InstanceType]
    """Instance types by key."""
    prices: dict[tuple[str, str], Price]
    """Prices by (instance, region or zone)."""
    zones: dict[str, UserZone]
    """User zones by name."""

    def provider(self, name: str) -> Provider:
        try:
            return self.providers[name]
        except KeyError:
            raise ValueError(f"unknown cloud provider {name!r}; known: {', '.join(self.providers)} "
                             "(add one under [providers.NAME] in a --catalog file)") from None

    def instance_for(self, gpu: str, gpus: int, cloud: Cloud) -> InstanceType | None:
        """The instance type of ``gpus`` x ``gpu`` on ``cloud`` (None: the catalog has none)."""
        return next((i for i in self.instances.values() if i.gpu == gpu and i.gpus == gpus
                     and i.cloud == cloud), None)

    def price(self, instance: InstanceType, zone: str) -> Price:
        """The instance's price in ``zone``: the zone's own, its region's (a user zone's
        ``region``, else the name less its last letter), else the instance's default."""
        user = self.zones.get(zone)
        region = user.region if user is not None and user.region else zone_region(zone)
        for where in (zone, region):
            if (instance.name, where) in self.prices:
                return self.prices[(instance.name, where)]
        return Price(instance=instance.name, region=instance.region,
                     spot_usd_per_h=instance.spot_usd_per_h,
                     on_demand_usd_per_h=instance.on_demand_usd_per_h, date=instance.date,
                     source=f"{instance.source} (the {instance.region} price stands in for {zone})")


def zone_region(zone: str) -> str:
    """``us-central1-a`` -> ``us-central1``; ``us-east-1a`` -> ``us-east-1``."""
    if zone[-1:].isalpha() and zone[-2:-1].isdigit():  # AWS: us-east-1a
        return zone[:-1]
    head, _, tail = zone.rpartition("-")
    return head if head and len(tail) == 1 else zone


_TABLES = {"providers": dict, "instances": list, "prices": list, "zones": list}
"""The top-level tables of a catalog file and their TOML form ([providers.NAME], [[instances]]...)."""


def _accepts(annotation: str, value: Any) -> bool:
    """Whether a TOML value fits a field annotation (``float`` also takes an int; a ``Cloud``
    is written as its name)."""
    options = annotation.split(" | ")
    number = isinstance(value, int | float) and not isinstance(value, bool)
    return (value is None and "None" in options) \
        or (isinstance(value, str) and bool({"str", "Cloud"} & set(options))) \
        or (number and "float" in options) or (number and isinstance(value, int) and "int" in options)


def _check(entry: dict[str, Any], cls: type, where: str, given: tuple[str, ...] = ()
           ) -> dict[str, Any]:
    """``entry`` once its keys are ``cls``'s fields (all it needs but ``given``) and its values
    fit their annotations."""
    known = {f.name: f for f in fields(cls)}
    unknown = [k for k in entry if k not in known]
    if unknown:
        raise ValueError(f"{where}: unknown key {', '.join(map(repr, unknown))}; valid keys: "
                         f"{', '.join(known)}")
    missing = [name for name, f in known.items() if name not in entry and name not in given
               and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}")
    types = {name: str(f.type) for name, f in known.items()}
    for key, value in entry.items():
        if not _accepts(types[key], value):
            raise ValueError(f"{where}: {key} must be {types[key]}, got {value!r}")
        if isinstance(value, float | int) and not isinstance(value, bool) and (
                not math.isfinite(value) or value < 0):
            raise ValueError(f"{where}: {key} must be a finite number >= 0, got {value!r}")
    return entry


def _instance(entry: dict[str, Any], label: str, providers: dict[str, Provider]) -> InstanceType:
    entry = {"on_demand_usd_per_h": None, "spot_usd_per_h": None, **entry}
    instance = InstanceType(**_check(entry, InstanceType, label))
    if instance.gpus < 1:
        raise ValueError(f"{label}: gpus must be at least 1 GPU per instance, got {instance.gpus}")
    if instance.gpu not in GPU_CATALOG:
        raise ValueError(f"{label}: unknown gpu {instance.gpu!r}; valid: {', '.join(GPU_CATALOG)} "
                         "(add it with meshmorph gpus --gpus FILE)")
    for link in (instance.interconnect, instance.network):
        if link not in LINKS:
            raise ValueError(f"{label}: unknown link {link!r}; valid: {', '.join(LINKS)}")
    if instance.provider not in providers:
        raise ValueError(f"{label}: unknown provider {instance.provider!r}; known: "
                         f"{', '.join(providers)}")
    return instance


def _provider(name: str, entry: dict[str, Any], where: str) -> Provider:
    entry = dict(_check(entry, Provider, f"{where} [providers.{name}]", given=("name",)))
    cloud = entry.pop("cloud", "other")
    try:
        return Provider(name=name, cloud=Cloud(cloud), **entry)
    except ValueError as exc:
        if "Cloud" in str(exc):
            raise ValueError(f"{where} [providers.{name}]: cloud {cloud!r} is not one of "
                             f"{', '.join(c.value for c in Cloud)}") from None
        raise ValueError(f"{where} [providers.{name}]: {exc}") from None


def _entries(data: dict[str, Any], key: str, cls: type, where: str) -> list[Any]:
    out = []
    for index, entry in enumerate(data.get(key, [])):
        label = f"{where} [[{key}]] #{index + 1}"
        try:
            out.append(cls(**_check(entry, cls, label)))
        except TypeError as exc:
            raise ValueError(f"{label}: {exc}") from None
    return out


def _parse(data: dict[str, Any], where: str, catalog: CloudCatalog | None) -> CloudCatalog:
    unknown = [key for key in data if key not in _TABLES]
    if unknown:
        raise ValueError(f"{where}: unknown table {', '.join(map(repr, unknown))}; a catalog holds "
                         "[providers.NAME], [[instances]], [[prices]] and [[zones]] (see "
                         "examples/my_zones.toml)")
    for key, kind in _TABLES.items():
        value = data.get(key, kind())
        entries = value.values() if isinstance(value, dict) else value
        if not isinstance(value, kind) or not all(isinstance(e, dict) for e in entries):
            form = f"[{key}.NAME] tables" if kind is dict else f"[[{key}]] tables"
            raise ValueError(f"{where}: {key} must be {form}, got {value!r}")
    base = catalog or CloudCatalog(providers={}, instances={}, prices={}, zones={})
    providers, instances = dict(base.providers), dict(base.instances)
    prices, zones = dict(base.prices), dict(base.zones)
    for name, entry in data.get("providers", {}).items():
        providers[name] = _provider(name, entry, where)
    for index, entry in enumerate(data.get("instances", [])):
        instance = _instance(entry, f"{where} [[instances]] #{index + 1}", providers)
        instances[instance.name] = instance
    for price in _entries(data, "prices", Price, where):
        if price.instance not in instances:
            raise ValueError(f"{where}: a price for unknown instance {price.instance!r}; known: "
                             f"{', '.join(instances)}")
        prices[(price.instance, price.region)] = price
    for zone in _entries(data, "zones", UserZone, where):
        if zone.provider not in providers:
            raise ValueError(f"{where}: zone {zone.name}: unknown provider {zone.provider!r}; "
                             f"known: {', '.join(providers)}")
        zones[zone.name] = zone
    return CloudCatalog(providers=providers, instances=instances, prices=prices, zones=zones)


def load_catalog(user: Path | str | None = None) -> CloudCatalog:
    """The packaged catalog, with a user TOML's entries added or replacing those of the same name."""
    text = resources.files("meshmorph.data").joinpath("cloud_catalog.toml").read_text()
    catalog = _parse(tomllib.loads(text), "cloud_catalog.toml", None)
    if user is None:
        return catalog
    path = Path(user)
    data = read_document(path, what="catalog file", fmt="toml", way_out=(
        "pass a TOML of [providers.NAME], [[instances]], [[prices]] and [[zones]] tables "
        "(examples/my_zones.toml)"))
    return _parse(data, str(path), catalog)
