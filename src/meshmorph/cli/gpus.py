"""``meshmorph gpus``: list the GPU catalog (and a user's additions)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from meshmorph.cli.output import add_output, add_wide, write_json
from meshmorph.spec.gpus import GPU_CATALOG, LINKS, load_gpus_toml
from meshmorph.tables import Column, print_table, report_console

GPU_COLUMNS = (Column("name", justify="left"), Column("memory GiB", "GiB"),
               Column("HBM GB/s", "HBM"), Column("fp32", drop=2), Column("tf32", drop=3),
               Column("bf16"), Column("fp8", drop=1),
               Column("links (node / net)", "links", "left", wrap=16),
               Column("$/GPU-h", "$/h"), Column("spot $/h", "spot"),
               Column("read", justify="left", drop=4))
"""Columns of ``meshmorph gpus``: dense TFLOP/s per dtype, links, prices; when 100 columns
do not hold them, the headers shorten and the links wrap."""


def gpu_rows() -> list[dict[str, Any]]:
    """One row per catalog GPU: memory, bandwidth, dense peaks, links (figures), dated prices."""

    def link_row(name: str) -> dict[str, Any]:
        return {"name": name, "bandwidth_gbps": LINKS[name].bandwidth_gbps,
                "latency_us": LINKS[name].latency_us}

    return [{"name": g.name, "part": g.description, "memory_gib": g.memory_gib,
             "hbm_gbps": g.hbm_gbps, "peak_tflops": dict(g.peak_tflops),
             "intra_node_link": g.intra_node_link, "inter_node_link": g.inter_node_link,
             "intra_node": link_row(g.intra_node_link), "inter_node": link_row(g.inter_node_link),
             "price_per_hour": g.price_per_hour, "spot_price_per_hour": g.spot_price_per_hour,
             "price_date": g.price_date, "price_source": g.price_source}
            for g in GPU_CATALOG.values()]


def _gpus(args: argparse.Namespace) -> int:
    if args.gpus is not None:
        load_gpus_toml(args.gpus)
    rows = gpu_rows()
    def price(value: float | None) -> str:
        return f"{value:.2f}" if value is not None else "-"

    cells = []
    for r in rows:
        peaks = [f"{r['peak_tflops'][d]:g}" if d in r["peak_tflops"] else "-"
                 for d in ("fp32", "tf32", "bf16", "fp8")]
        cells.append([r["name"], f"{r['memory_gib']:g}", f"{r['hbm_gbps']:g}", *peaks,
                      f"{r['intra_node_link']} / {r['inter_node_link']}",
                      price(r["price_per_hour"]), price(r["spot_price_per_hour"]),
                      r["price_date"] or "-"])
    used = sorted({r[k] for r in rows for k in ("intra_node_link", "inter_node_link")})
    links = []
    for r in rows:
        for row in (r["intra_node"], r["inter_node"]):
            if row["name"] in used:
                used.remove(row["name"])
                links.append([row["name"], f"{row['bandwidth_gbps']:.3g}",
                              f"{row['latency_us']:g}"])
    console = report_console(args.wide)
    print_table(console, GPU_COLUMNS, cells, title="GPU catalog (dense peaks, no sparsity)")
    print_table(console, (Column("link", justify="left"), Column("GB/s"), Column("latency us")),
                links, title="links (per GPU, per direction)")
    console.print("peak columns are dense TFLOP/s; link GB/s per GPU per direction; prices USD per "
                  "GPU-hour, 'read' = when the price was read (- : undated typical list price); "
                  "add or override entries with --gpus FILE")
    if args.json:
        write_json(args.json, {"gpus": rows})
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    gpus = subparsers.add_parser("gpus", help="list the GPU catalog")
    add_output(gpus, "--json", help="also write the list as JSON")
    gpus.add_argument("--gpus", type=Path, default=None,
                      help="TOML file of [gpus.NAME] (and [links.NAME]) tables that add GPUs or "
                           "override catalog figures and prices")
    add_wide(gpus)
    gpus.set_defaults(func=_gpus)
