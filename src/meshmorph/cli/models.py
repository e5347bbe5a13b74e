"""``meshmorph models``: list the model catalog."""

from __future__ import annotations

import argparse
from typing import Any

from meshmorph.cli.output import add_output, add_wide, write_json
from meshmorph.spec.catalog import MODEL_CATALOG
from meshmorph.spec.transformer import build_transformer
from meshmorph.tables import Column, print_table, report_console

MODEL_COLUMNS = (Column("name", justify="left"), Column("arch", justify="left"), Column("layers"),
                 Column("hidden"), Column("heads/kv"), Column("ffn"), Column("vocab"),
                 Column("seq"), Column("params (B)"))
"""Columns of ``meshmorph models`` (they fit 100 columns as they are)."""


def model_rows() -> list[dict[str, Any]]:
    """One row per catalog model: its shape and parameter count."""

    rows = []
    for name, shape in MODEL_CATALOG.items():
        spec = build_transformer(shape)
        rows.append({"name": name, "arch": shape.arch, "layers": spec.num_blocks,
                     "hidden": spec.hidden_size, "heads": spec.num_heads,
                     "kv_heads": spec.num_kv_heads, "ffn": spec.ffn_hidden_size,
                     "vocab": spec.vocab_size, "seq_len": spec.seq_len,
                     "params": spec.num_params, "params_b": spec.num_params / 1e9})
    return rows


def _models(args: argparse.Namespace) -> int:
    rows = model_rows()
    cells = [[r["name"], r["arch"], str(r["layers"]), str(r["hidden"]),
              f"{r['heads']}/{r['kv_heads']}", str(r["ffn"]), str(r["vocab"]), str(r["seq_len"]),
              f"{r['params_b']:.2f}" if r["params_b"] >= 0.01 else f"{r['params_b']:.5f}"]
             for r in rows]
    console = report_console(args.wide)
    print_table(console, MODEL_COLUMNS, cells, title="model catalog")
    if args.json:
        write_json(args.json, {"models": rows})
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    models = subparsers.add_parser("models", help="list the model catalog")
    add_output(models, "--json", help="also write the list as JSON")
    add_wide(models)
    models.set_defaults(func=_models)
