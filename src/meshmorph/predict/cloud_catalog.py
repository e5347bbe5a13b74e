"""The cloud catalog: transient offerings (notice, cap, hazard) and instance types with dated
prices, from ``data/cloud_catalog.toml`` and an optional user TOML of the same form."""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any

from meshmorph.predict.revocation import Hazard, fitted_hazards
from meshmorph.spec.gpus import GPU_CATALOG, LINKS


@dataclass(frozen=True, slots=True, kw_only=True)
class Provider:
    """A transient (or on-demand) offering's rules."""

    name: str
    """Catalog key (``gcp-preemptible``)."""
    notice_s: float
    """Warning before a revocation, seconds."""
    max_runtime_h: float | None = None
    """The provider stops a VM at this age; None: no cap."""
    hazard: str = ""
    """``cmdare``: CM-DARE's fitted age hazard; empty: the constant ``rate_per_h``."""
    rate_per_h: float = 0.0
    """Constant revocations per VM-hour (when ``hazard`` is empty)."""
    source: str = ""
    """Where the rules come from."""

    def hazard_for(self, gpu: str) -> Hazard:
        """The revocation hazard of one VM of this offering carrying ``gpu``."""
        if self.hazard == "cmdare":
            fitted = fitted_hazards()
            base = fitted.get(gpu.split("-")[0], fitted["any"])
            return Hazard(name=f"{self.name}/{gpu}", rates_per_h=base.rates_per_h,
                          tail_rate_per_h=base.rates_per_h[-1], max_runtime_h=self.max_runtime_h,
                          notice_s=self.notice_s)
        if self.hazard:
            raise ValueError(f"provider {self.name}: unknown hazard {self.hazard!r}; use 'cmdare' "
                             "or leave it out and give rate_per_h")
        return Hazard(name=f"{self.name}/{gpu}", edges_h=(0.0,), rates_per_h=(),
                      tail_rate_per_h=self.rate_per_h, max_runtime_h=self.max_runtime_h,
                      notice_s=self.notice_s)


@dataclass(frozen=True, slots=True, kw_only=True)
class InstanceType:
    """One rentable VM shape with its prices."""

    name: str
    """Catalog key (``aws-p3.2xlarge``)."""
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
    """Region or zone the price applies to."""
    date: str
    """When the price was read."""
    source: str
    """Where the price comes from."""

    def price_per_gpu_hour(self, spot: bool) -> float | None:
        price = self.spot_usd_per_h if spot else self.on_demand_usd_per_h
        return None if price is None else price / self.gpus


@dataclass(frozen=True, slots=True)
class CloudCatalog:
    """Providers and instance types by name."""

    providers: dict[str, Provider]
    """Offerings by key."""
    instances: dict[str, InstanceType]
    """Instance types by key."""

    def provider(self, name: str) -> Provider:
        try:
            return self.providers[name]
        except KeyError:
            raise ValueError(f"unknown cloud provider {name!r}; known: {', '.join(self.providers)} "
                             "(add one under [providers.NAME] in a --catalog file)") from None


def _check(entry: dict[str, Any], cls: type, where: str) -> dict[str, Any]:
    names = [f.name for f in fields(cls)]
    unknown = [k for k in entry if k not in names]
    if unknown:
        raise ValueError(f"{where}: unknown key {', '.join(map(repr, unknown))}; valid keys: "
                         f"{', '.join(names)}")
    for key, value in entry.items():
        if isinstance(value, float | int) and not isinstance(value, bool) and (
                not math.isfinite(value) or value < 0):
            raise ValueError(f"{where}: {key} must be a finite number >= 0, got {value!r}")
    return entry


def _parse(data: dict[str, Any], where: str, catalog: CloudCatalog | None) -> CloudCatalog:
    providers = dict(catalog.providers) if catalog else {}
    instances = dict(catalog.instances) if catalog else {}
    for name, entry in data.get("providers", {}).items():
        providers[name] = Provider(name=name, **_check(entry, Provider, f"{where} [providers.{name}]"))
    for index, entry in enumerate(data.get("instances", [])):
        label = f"{where} [[instances]] #{index + 1}"
        entry = {"on_demand_usd_per_h": None, "spot_usd_per_h": None, **entry}
        missing = [f.name for f in fields(InstanceType) if f.name not in entry]
        if missing:
            raise ValueError(f"{label}: missing {', '.join(missing)}")
        instance = InstanceType(**_check(entry, InstanceType, label))
        if instance.gpu not in GPU_CATALOG:
            raise ValueError(f"{label}: unknown gpu {instance.gpu!r}; valid: {', '.join(GPU_CATALOG)} "
                             "(add it with meshmorph gpus --gpus FILE)")
        for link in (instance.interconnect, instance.network):
            if link not in LINKS:
                raise ValueError(f"{label}: unknown link {link!r}; valid: {', '.join(LINKS)}")
        if instance.provider not in providers:
            raise ValueError(f"{label}: unknown provider {instance.provider!r}; known: "
                             f"{', '.join(providers)}")
        instances[instance.name] = instance
    return CloudCatalog(providers=providers, instances=instances)


def load_catalog(user: Path | str | None = None) -> CloudCatalog:
    """The packaged catalog, with a user TOML's entries added or replacing those of the same name."""
    text = resources.files("meshmorph.data").joinpath("cloud_catalog.toml").read_text()
    catalog = _parse(tomllib.loads(text), "cloud_catalog.toml", None)
    if user is None:
        return catalog
    path = Path(user)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"catalog file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path} is not valid TOML: {exc}") from None
    return _parse(data, str(path), catalog)
