"""``meshmorph models``: list the model catalog."""

from __future__ import annotations

import argparse
from typing import Any

from meshmorph.cli.output import add_output, write_json
from meshmorph.plan.report import report_console
from meshmorph.spec.catalog import MODEL_CATALOG
from meshmorph.spec.transformer import build_transformer


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
    from rich.table import Table

    rows = model_rows()
    table = Table(title="model catalog", title_justify="left")
    for name in ("name", "arch", "layers", "hidden", "heads/kv", "ffn", "vocab", "seq",
                 "params (B)"):
        table.add_column(name, justify="left" if name in ("name", "arch") else "right")
    for r in rows:
        params = f"{r['params_b']:.2f}" if r["params_b"] >= 0.01 else f"{r['params_b']:.5f}"
        table.add_row(r["name"], r["arch"], str(r["layers"]), str(r["hidden"]),
                      f"{r['heads']}/{r['kv_heads']}", str(r["ffn"]), str(r["vocab"]),
                      str(r["seq_len"]), params)
    console = report_console()
    console.print(table)
    if args.json:
        write_json(args.json, {"models": rows})
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    models = subparsers.add_parser("models", help="list the model catalog")
    add_output(models, "--json", help="also write the list as JSON")
    models.set_defaults(func=_models)
