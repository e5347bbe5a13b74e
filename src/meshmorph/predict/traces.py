"""Recorded spot traces: per zone and probe tick, whether spot capacity was there.

Forms read (``load_trace``):

- a packaged trace by name: ``h100-gcp-2025-10`` (13 GCP zones, 16 x H100 asked every 10 min,
  Oct 2025) or ``l4-aws-2025-12`` (10 AWS zones, g6.12xlarge, Dec 2025), from
  ``data/spot_data.json``; a JSON file of the same form (``availability`` entries);
- the plain form of SkyNomad's simulator traces (``h100_16_traces/<zone>/full.json``): only
  ``metadata.gap_seconds`` (seconds per tick) and ``data`` (one 0/1 per tick, **1 = no
  capacity**) are required; ``metadata.zone`` (else the folder's name), ``metadata.price_info``
  (``price``, ``on_demand_price``: USD per instance-hour), ``prices`` (spot price per tick; their
  mean is used) and ``metadata.gap_filled`` (ticks filled by the authors, left out of fits) are
  read where present. A folder stands for every ``*/full.json`` under it (one zone each).

The GPU is the one the user simulates: a trace says when capacity was there, not what for.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from meshmorph.predict.measurements import packaged_json
from meshmorph.spec.gpus import is_figure

DIGITS = "0123456789abcdefg"
"""One base-17 digit per probe round of ``data/spot_data.json``'s H100 availability (how many
of 16 spot VMs launched, 0-16; scripts/spot_import.py writes them)."""

PACKAGED = ("h100-gcp-2025-10", "l4-aws-2025-12")
"""Trace names shipped in ``data/spot_data.json``."""


class TraceError(ValueError):
    """A trace file that cannot be read: names the file and the field."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ZoneTrace:
    """One zone's recorded capacity."""

    zone: str
    """Zone name."""
    states: tuple[bool, ...]
    """Per tick: capacity there (True) or not."""
    gaps: tuple[tuple[int, int], ...] = ()
    """Tick ranges ``[start, stop)`` left out of fits (filled or unknown); ``(i, i)`` splits the
    series at tick i (missing rounds)."""
    counts: tuple[int, ...] = ()
    """Count traces: GPUs launched per tick (empty: 0/1 traces)."""
    spot_usd_per_h: float | None = None
    """Spot price of the traced instance, USD per instance-hour (None: not recorded)."""
    on_demand_usd_per_h: float | None = None
    """On-demand price of the same instance (None: not recorded)."""
    price_date: str = ""
    """When the prices were read."""

    def segments(self) -> list[tuple[bool, ...]]:
        """The ticks to fit, split at the gaps."""
        edges = [0, *(i for gap in sorted(self.gaps) for i in gap), len(self.states)]
        pieces = (self.states[start:stop]
                  for start, stop in zip(edges[::2], edges[1::2], strict=True))
        return [segment for segment in pieces if segment]


@dataclass(frozen=True, slots=True, kw_only=True)
class SpotTrace:
    """A recorded capacity trace of one or more zones, on one tick."""

    name: str
    """Packaged name or file path."""
    tick_s: float
    """Seconds per tick."""
    zones: dict[str, ZoneTrace]
    """Zones by name."""
    gpu: str = ""
    """GPU type probed (empty: not stated; the simulated GPU is assumed)."""
    provider: str = ""
    """Cloud offering (a catalog provider), where known."""
    source: str = ""
    """Where the trace comes from (repository, licence)."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Anything else the file said (kept for the JSON output)."""


def _fail(path: str, key: str, problem: str) -> TraceError:
    return TraceError(f"trace {path}: {key}: {problem}")


def _number(value: Any, path: str, key: str) -> float:
    if not is_figure(value, zero_ok=False):
        raise _fail(path, key, f"must be a finite number > 0, got {value!r}")
    return float(value)


def _plain_zone(data: dict[str, Any], path: str, default_zone: str) -> tuple[float, ZoneTrace]:
    if not isinstance(data, dict):
        raise _fail(path, "(top level)", "must be a JSON object with 'metadata' and 'data'")
    meta = data.get("metadata")
    if not isinstance(meta, dict):
        raise _fail(path, "metadata", "missing or not an object; the plain form needs "
                                      "metadata.gap_seconds and data")
    if "gap_seconds" not in meta:
        raise _fail(path, "metadata.gap_seconds", "missing; give the seconds per tick")
    tick_s = _number(meta["gap_seconds"], path, "metadata.gap_seconds")
    ticks = data.get("data")
    if not isinstance(ticks, list) or not ticks:
        raise _fail(path, "data", "missing or empty; give one 0/1 per tick (1 = no capacity)")
    bad = next((i for i, v in enumerate(ticks) if v not in (0, 1) or isinstance(v, float)), None)
    if bad is not None:
        raise _fail(path, f"data[{bad}]", f"must be 0 (capacity) or 1 (none), got {ticks[bad]!r}")
    zone = meta.get("zone", default_zone)
    if not isinstance(zone, str) or not zone:
        raise _fail(path, "metadata.zone", f"must be a non-empty string, got {zone!r}")
    info = meta.get("price_info") or {}
    if not isinstance(info, dict):
        raise _fail(path, "metadata.price_info", f"must be an object with price and "
                                                 f"on_demand_price, got {info!r}")
    spot = info.get("price")
    prices = data.get("prices")
    if isinstance(prices, list) and prices:
        spot = sum(_number(p, path, "prices[]") for p in prices) / len(prices)
    gaps = ()
    filled = meta.get("gap_filled")
    if isinstance(filled, dict) and {"gap_start_index", "gap_end_index"} <= set(filled):
        start, end = filled["gap_start_index"], filled["gap_end_index"]
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in (start, end)) \
                or not 0 <= start <= end < len(ticks):
            raise _fail(path, "metadata.gap_filled", f"needs whole tick indices 0 <= "
                                                     f"gap_start_index <= gap_end_index < "
                                                     f"{len(ticks)}, got {start!r} and {end!r}")
        gaps = ((start, end + 1),)
    return tick_s, ZoneTrace(
        zone=zone, states=tuple(v == 0 for v in ticks), gaps=gaps,
        spot_usd_per_h=None if spot is None else _number(spot, path, "metadata.price_info.price"),
        on_demand_usd_per_h=None if info.get("on_demand_price") is None else _number(
            info["on_demand_price"], path, "metadata.price_info.on_demand_price"),
        price_date=str(info.get("fetched_at", ""))[:10])


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"trace file {path} does not exist; give a trace file, a folder "
                                f"of */full.json, or one of {', '.join(PACKAGED)}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _fail(str(path), "(file)", f"not valid JSON ({exc})") from None


def _plain_files(paths: list[Path], name: str) -> SpotTrace:
    zones, ticks = {}, set()
    for path in paths:
        tick_s, zone = _plain_zone(_read_json(path), str(path), path.parent.name or path.stem)
        if zone.zone in zones:
            raise _fail(str(path), "metadata.zone", f"zone {zone.zone} appears twice; give each "
                                                    "zone once")
        zones[zone.zone] = zone
        ticks.add(tick_s)
    if len(ticks) > 1:
        raise _fail(name, "metadata.gap_seconds", f"the zones use different ticks "
                                                  f"({sorted(ticks)} s); give traces on one tick")
    return SpotTrace(name=name, tick_s=ticks.pop(), zones=zones)


def _priced(zone: str, states: tuple[bool, ...], price: dict[str, Any], **fields: Any
            ) -> ZoneTrace:
    """A packaged zone's trace with its price entry (``spot_usd_per_h``, ``on_demand_usd_per_h``,
    ``date``)."""
    return ZoneTrace(zone=zone, states=states, spot_usd_per_h=price.get("spot_usd_per_h"),
                     on_demand_usd_per_h=price.get("on_demand_usd_per_h"),
                     price_date=price.get("date", ""), **fields)


def _count_trace(name: str, entry: dict[str, Any]) -> SpotTrace:
    """A count trace (``segments`` of base-17 digits per zone): capacity = at least 1 launched."""
    counts: dict[str, list[int]] = {}
    gaps: dict[str, list[tuple[int, int]]] = {}
    for segment in entry["segments"]:
        for zone, digits in segment["rounds"].items():
            done = counts.setdefault(zone, [])
            if done:
                gaps.setdefault(zone, []).append((len(done), len(done)))
            done.extend(DIGITS.index(d) for d in digits)
    prices = entry.get("a3_highgpu_8g_prices", {})
    zones = {zone: _priced(zone, tuple(c >= 1 for c in values),
                           prices.get(zone.rsplit("-", 1)[0], {}),
                           gaps=tuple(gaps.get(zone, ())), counts=tuple(values))
             for zone, values in counts.items()}
    return SpotTrace(name=name, tick_s=_number(entry["tick_s"], name, "tick_s"), zones=zones,
                     gpu=entry["gpu"], provider=entry["provider"], source=entry["source"],
                     meta={"about": entry["about"], "requested_gpus": entry["requested_gpus"]})


def _probe_trace(name: str, entry: dict[str, Any]) -> SpotTrace:
    """A probe trace (one character per tick: 1, 0, - not probed yet) on irregular ticks, read on
    their mean tick."""
    times = entry["tick_times_s"]
    if len(times) < 2 or not times[-1] > times[0]:
        raise _fail(name, "tick_times_s", f"needs at least two increasing times, got {times!r}")
    tick_s = (times[-1] - times[0]) / (len(times) - 1)
    prices = entry.get("g6_12xlarge_prices", {})
    zones = {}
    for zone, chars in entry["zones"].items():
        unknown = len(chars) - len(chars.lstrip("-"))
        zones[zone] = _priced(zone, tuple(c == "1" for c in chars), prices.get(zone, {}),
                              gaps=((0, unknown),) if unknown else ())
    return SpotTrace(name=name, tick_s=tick_s, zones=zones, gpu=entry["gpu"],
                     provider=entry["provider"], source=entry["source"],
                     meta={"about": entry["about"]})


def trace_from_entry(name: str, entry: dict[str, Any]) -> SpotTrace:
    """A trace from one ``availability`` entry of the packaged form."""
    kinds = {"counts": _count_trace, "probes": _probe_trace}
    kind = entry.get("kind") if isinstance(entry, dict) else None
    if kind not in kinds:
        raise _fail(name, "kind", f"{kind!r} is not a replayable trace; use one of "
                                  f"{', '.join(kinds)}")
    try:
        return kinds[kind](name, entry)
    except TraceError:
        raise
    except (KeyError, ValueError, TypeError, IndexError) as exc:
        raise _fail(name, str(exc).strip("'"), "missing or malformed") from None


@cache
def packaged_trace(name: str) -> SpotTrace:
    if name not in PACKAGED:
        raise TraceError(f"no packaged trace {name!r}; packaged: {', '.join(PACKAGED)}")
    return trace_from_entry(name, packaged_json("spot_data.json")["availability"][name])


def load_trace(spec: str | Path) -> SpotTrace:
    """A trace by packaged name, plain-form file, folder of ``*/full.json`` or packaged-form file
    (a JSON object whose ``availability`` maps names to entries; the first replayable one)."""
    if str(spec) in PACKAGED:
        return packaged_trace(str(spec))
    path = Path(spec)
    if path.is_dir():
        files = sorted(path.glob("*/full.json")) or sorted(path.glob("*.json"))
        if not files:
            raise FileNotFoundError(f"trace folder {path} holds no */full.json; give a trace "
                                    "file or a folder of zone folders with full.json")
        return _plain_files(files, str(path))
    data = _read_json(path)
    if isinstance(data, dict) and "availability" in data:
        entries = data["availability"]
        if not isinstance(entries, dict) or not entries:
            raise _fail(str(path), "availability", "must map trace names to entries")
        name, entry = next(iter(entries.items()))
        return trace_from_entry(f"{path}:{name}", entry)
    return _plain_files([path], str(path))
