"""The import graph of src/meshmorph: packages import one way only (module- and function-level
imports alike), and planning needs no torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "meshmorph"
LAYERS = (("files", "schedule", "tables"), ("spec",), ("cost",), ("plan",),
          ("run", "elastic", "predict", "profile", "streams", "demos"), ("viz",), ("cli",),
          ("__main__",))
"""Packages from the bottom up: a package imports only from its own layer or below; within the
layer of run, elastic, predict, profile, streams and demos, the edges form no cycle."""


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "meshmorph"


def package_edges() -> set[tuple[str, str, str]]:
    """(importing package, imported package, where) of every import of meshmorph, at any depth."""
    edges = set()
    for path in SRC.rglob("*.py"):
        source = _package("meshmorph." + ".".join(path.relative_to(SRC).with_suffix("").parts))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module \
                    and node.module.startswith("meshmorph."):
                targets = [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("meshmorph.")]
            else:
                continue
            for target in targets:
                if _package(target) != source:
                    edges.add((source, _package(target), f"{path.relative_to(SRC)}:{node.lineno}"))
    return edges


def test_the_packages_import_one_way_with_no_cycle() -> None:
    layer_of = {name: index for index, names in enumerate(LAYERS) for name in names}
    edges = package_edges()
    upward = sorted(e for e in edges if layer_of[e[1]] > layer_of[e[0]])
    assert not upward, f"imports against the direction of the layers: {upward}"
    graph = nx.DiGraph((a, b) for a, b, _ in edges)
    cycles = [c for c in nx.strongly_connected_components(graph) if len(c) > 1]
    assert not cycles, f"package cycles: {cycles}"


@pytest.mark.parametrize("module", ["meshmorph.plan.search", "meshmorph.cost.model",
                                    "meshmorph.cli.app", "meshmorph.predict.simulate",
                                    "meshmorph.spec.runnable", "meshmorph.cost.rank_state"])
def test_planning_and_the_command_line_import_no_torch(module: str) -> None:
    code = f"import sys, {module}; print('torch' in sys.modules, 'torchao' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False False", f"{module} imports torch or torchao"


def test_every_subcommand_registers_without_torch() -> None:
    # the parser registers every subcommand, so any meshmorph command line (plan, --help) pays
    # for what their modules import: torch and its pipelining took 2.5 s of every start
    code = ("import sys; from meshmorph.cli.app import build_parser; build_parser(); "
            "print('torch' in sys.modules, 'torchao' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False False", "a subcommand's module imports torch or torchao"
