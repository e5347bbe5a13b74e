"""``meshmorph models`` and ``meshmorph gpus``: list the model and GPU catalogs (the GPUs with a
user's additions)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from meshmorph.cli.output import finish, write_json
from meshmorph.spec.catalog import MODEL_CATALOG
from meshmorph.spec.gpus import GPU_CATALOG, LINKS, load_gpus_toml
from meshmorph.spec.transformer import build_transformer
from meshmorph.tables import Column, print_table, report_console

MODEL_COLUMNS = (Column("name", justify="left"), Column("arch", justify="left"), Column("layers"),
                 Column("hidden"), Column("heads/kv"), Column("ffn"), Column("vocab"),
                 Column("seq"), Column("params (B)"))
"""Columns of ``meshmorph models`` (they fit 100 columns as they are)."""

GPU_COLUMNS = (Column("name", justify="left"), Column("memory GiB", "GiB"),
               Column("HBM GB/s", "HBM"), Column("fp32", drop=2), Column("tf32", drop=3),
               Column("bf16"), Column("fp8", drop=1),
               Column("links (node / net)", "links", "left", wrap=16),
               Column("$/GPU-h", "$/h"), Column("spot $/h", "spot"),
               Column("read", justify="left", drop=4))
"""Columns of ``meshmorph gpus``: dense TFLOP/s per dtype, links, prices; when 100 columns
do not hold them, the headers shorten and the links wrap."""


def _models(args: argparse.Namespace) -> int:
    rows = []
    for name, shape in MODEL_CATALOG.items():
        spec = build_transformer(shape)
        rows.append({"name": name, "arch": shape.arch, "layers": spec.num_blocks,
                     "hidden": spec.hidden_size, "heads": spec.num_heads,
                     "kv_heads": spec.num_kv_heads, "ffn": spec.ffn_hidden_size,
                     "vocab": spec.vocab_size, "seq_len": spec.seq_len,
                     "params": spec.num_params, "params_b": spec.num_params / 1e9})
    cells = [[r["name"], r["arch"], str(r["layers"]), str(r["hidden"]),
              f"{r['heads']}/{r['kv_heads']}", str(r["ffn"]), str(r["vocab"]), str(r["seq_len"]),
              f"{r['params_b']:.2f}" if r["params_b"] >= 0.01 else f"{r['params_b']:.5f}"]
             for r in rows]
    print_table(report_console(args.wide), MODEL_COLUMNS, cells, title="model catalog")
    if args.json:
        write_json(args.json, {"models": rows})
    return 0


def _link(name: str) -> dict[str, Any]:
    return {"name": name, "bandwidth_gbps": LINKS[name].bandwidth_gbps,
            "latency_us": LINKS[name].latency_us}


def _gpus(args: argparse.Namespace) -> int:
    if args.gpus is not None:
        load_gpus_toml(args.gpus)
    rows = [{"name": g.name, "part": g.description, "memory_gib": g.memory_gib,
             "hbm_gbps": g.hbm_gbps, "peak_tflops": dict(g.peak_tflops),
             "intra_node_link": g.intra_node_link, "inter_node_link": g.inter_node_link,
             "intra_node": _link(g.intra_node_link), "inter_node": _link(g.inter_node_link),
             "price_per_hour": g.price_per_hour, "spot_price_per_hour": g.spot_price_per_hour,
             "price_date": g.price_date, "price_source": g.price_source}
            for g in GPU_CATALOG.values()]

    def price(value: float | None) -> str:
        return f"{value:.2f}" if value is not None else "-"

    cells = [[r["name"], f"{r['memory_gib']:g}", f"{r['hbm_gbps']:g}",
              *(f"{r['peak_tflops'][d]:g}" if d in r["peak_tflops"] else "-"
                for d in ("fp32", "tf32", "bf16", "fp8")),
              f"{r['intra_node_link']} / {r['inter_node_link']}", price(r["price_per_hour"]),
              price(r["spot_price_per_hour"]), r["price_date"] or "-"] for r in rows]
    # each link the GPUs use, once, in the order the rows first name it
    used = dict.fromkeys(r[k]["name"] for r in rows for k in ("intra_node", "inter_node"))
    links = [[name, f"{LINKS[name].bandwidth_gbps:.3g}", f"{LINKS[name].latency_us:g}"]
             for name in used]
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
    models = subparsers.add_parser("models", help="list the model catalog")
    finish(models, _models, json="also write the list as JSON")
    gpus = subparsers.add_parser("gpus", help="list the GPU catalog")
    gpus.add_argument("--gpus", type=Path, default=None,
                      help="TOML file of [gpus.NAME] (and [links.NAME]) tables that add GPUs or "
                           "override catalog figures and prices")
    finish(gpus, _gpus, json="also write the list as JSON")
