"""Read a Cluster from a TOML file.

```toml
name = "mixed"                      # optional; default: the file stem
inter_node_link = "ib-hdr"          # optional; default: the slowest default NIC of the groups
# or a custom link (either figure may be left out; it then comes from inter_node_link/the default):
# [inter_node]
# bandwidth_gbps = 25
# latency_us = 5

[[groups]]
gpu = "h100"
nodes = 4
gpus_per_node = 8
intra_node_link = "nvlink4"         # optional; default: the GPU's own
# intra_node_bandwidth_gbps = 400   # optional custom figures on top of that link
# intra_node_latency_us = 3
transient = false                   # optional: spot/preemptible nodes
price_per_gpu_hour = 2.5            # optional: USD; default: the GPU catalog's figure
```

Optional extras: ``provider = "gcp-preemptible"`` (the cloud offering of the transient groups, a
provider of meshmorph's cloud catalog), and ``[gpus.NAME]`` / ``[links.NAME]`` tables that add or
change GPUs and links for this file only (same keys as ``meshmorph gpus --gpus FILE``).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from meshmorph.files import read_document
from meshmorph.spec.cluster import Cluster, NodeGroup
from meshmorph.spec.gpus import GPU_CATALOG, GPUSpec, LinkSpec, gpus_from_toml, is_figure

_TOP_KEYS = ("name", "inter_node_link", "inter_node", "groups", "provider", "gpus", "links")
_INTER_KEYS = ("bandwidth_gbps", "latency_us")
_GROUP_KEYS = ("gpu", "nodes", "gpus_per_node", "intra_node_link", "intra_node_bandwidth_gbps",
               "intra_node_latency_us", "transient", "price_per_gpu_hour")
_GROUP_REQUIRED = ("gpu", "nodes", "gpus_per_node")


def load_cluster_toml(path: Path | str) -> Cluster:
    """A Cluster from a TOML file (format in this module's docstring)."""
    path = Path(path)
    data = read_document(path, what="cluster file", fmt="toml", way_out=(
        "fix it (the format is in examples/clusters/) or pass shorthand such as 'h100:4x8'"))
    _check_keys(data, _TOP_KEYS, path, "the top level")
    groups_data = data.get("groups")
    if not isinstance(groups_data, list) or not groups_data:
        raise ValueError(
            f"{path}: needs at least one [[groups]] table with keys {', '.join(_GROUP_REQUIRED)}"
        )
    own_gpus, links = gpus_from_toml(data, str(path))
    catalog = {**GPU_CATALOG, **own_gpus}
    groups = tuple(_group(entry, index, path, catalog, links)
                   for index, entry in enumerate(groups_data))
    name = data.get("name", path.stem)
    provider = data.get("provider", "")
    for key, value in (("name", name), ("provider", provider)):
        if not isinstance(value, str):
            raise ValueError(f"{path}: {key} must be a string, got {value!r}")
    return Cluster(groups=groups, inter_link=_inter_link(data, groups, path, links), name=name,
                   provider=provider)


def _check_keys(table: Any, valid: tuple[str, ...], path: Path, where: str) -> None:
    if not isinstance(table, dict):
        raise ValueError(f"{path}: {where} must be a table, got {table!r}")
    unknown = [key for key in table if key not in valid]
    if unknown:
        raise ValueError(
            f"{path}: unknown key {', '.join(map(repr, unknown))} in {where}; valid keys: "
            f"{', '.join(valid)}"
        )


def _positive_int(table: dict[str, Any], key: str, path: Path, where: str) -> int:
    value = table[key]
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{path}: {key} in {where} must be a positive integer, got {value!r}")
    return value


def _number(table: dict[str, Any], key: str, path: Path, where: str, *, allow_zero: bool) -> float:
    value = table[key]
    if not is_figure(value, zero_ok=allow_zero):
        bound = "a number >= 0" if allow_zero else "a positive number"
        raise ValueError(f"{path}: {key} in {where} must be {bound}, got {value!r}")
    return float(value)


def _named_link(name: Any, key: str, path: Path, where: str,
                links: dict[str, LinkSpec]) -> LinkSpec:
    if not isinstance(name, str) or name not in links:
        raise ValueError(f"{path}: unknown {key} {name!r} in {where}; valid links: {', '.join(links)}")
    return links[name]


def _with_figures(base: LinkSpec, table: dict[str, Any], bandwidth_key: str, latency_key: str,
                  path: Path, where: str) -> LinkSpec:
    """``base`` with the bandwidth and/or latency the file sets; renamed ``<base>-custom`` if changed."""
    changes: dict[str, Any] = {}
    if bandwidth_key in table:
        changes["bandwidth_gbps"] = _number(table, bandwidth_key, path, where, allow_zero=False)
    if latency_key in table:
        changes["latency_us"] = _number(table, latency_key, path, where, allow_zero=True)
    return replace(base, name=f"{base.name}-custom", **changes) if changes else base


def _group(entry: Any, index: int, path: Path, catalog: dict[str, GPUSpec],
           links: dict[str, LinkSpec]) -> NodeGroup:
    where = f"[[groups]] #{index + 1}"
    _check_keys(entry, _GROUP_KEYS, path, where)
    missing = [key for key in _GROUP_REQUIRED if key not in entry]
    if missing:
        raise ValueError(f"{path}: {where} is missing {', '.join(missing)} "
                         f"(every group needs {', '.join(_GROUP_REQUIRED)})")
    name = entry["gpu"]
    if not isinstance(name, str) or name.lower() not in catalog:
        raise ValueError(f"{path}: unknown gpu {name!r} in {where}; valid GPUs: {', '.join(catalog)} "
                         "(or define it in a [gpus.NAME] table)")
    spec = catalog[name.lower()]
    base = _named_link(entry.get("intra_node_link", spec.intra_node_link), "intra_node_link", path,
                       where, links)
    intra = _with_figures(base, entry, "intra_node_bandwidth_gbps", "intra_node_latency_us", path, where)
    transient = entry.get("transient", False)
    if not isinstance(transient, bool):
        raise ValueError(f"{path}: transient in {where} must be true or false, got {transient!r}")
    price = (_number(entry, "price_per_gpu_hour", path, where, allow_zero=True)
             if "price_per_gpu_hour" in entry else None)
    return NodeGroup(gpu=spec, num_nodes=_positive_int(entry, "nodes", path, where),
                     gpus_per_node=_positive_int(entry, "gpus_per_node", path, where),
                     intra_link=intra, transient=transient, price_per_gpu_hour=price)


def _inter_link(data: dict[str, Any], groups: tuple[NodeGroup, ...], path: Path,
                links: dict[str, LinkSpec]) -> LinkSpec:
    if "inter_node_link" in data:
        base = _named_link(data["inter_node_link"], "inter_node_link", path, "the top level", links)
    else:
        # between nodes, the slowest default NIC of the groups (as the shorthand does)
        base = min((links[g.gpu.inter_node_link] for g in groups), key=lambda lk: lk.bandwidth_gbps)
    if "inter_node" not in data:
        return base
    _check_keys(data["inter_node"], _INTER_KEYS, path, "[inter_node]")
    return _with_figures(base, data["inter_node"], "bandwidth_gbps", "latency_us", path, "[inter_node]")
