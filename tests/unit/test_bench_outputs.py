"""The bench scripts write a new file by default and the committed results only with --update
(bench/results_path.py); no benchmark runs here: the helper is called directly and the scripts
are read, not run."""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

import results_path  # noqa: E402
from results_path import Outputs  # noqa: E402

EXEMPT = {"results_path.py", "plan_speed.py"}
"""The helper itself; plan_speed.py writes only to an --out it is given (no default)."""
SCRIPTS = sorted(p for p in BENCH.glob("*.py")
                 if p.name not in EXEMPT and '__name__ == "__main__"' in p.read_text())


def parse(outputs: Outputs, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    outputs.add_args(parser)
    return parser.parse_args(argv)


def test_default_is_a_new_file_outside_the_committed_results() -> None:
    outputs = Outputs("bench/results/calibration.json")
    path = outputs.target(parse(outputs, []))
    assert path == results_path.LATEST / "calibration.json"
    assert path != outputs.committed_path() and path.parent != results_path.RESULTS
    latest = results_path.LATEST.relative_to(ROOT).as_posix()
    assert f"{latest}/" in (ROOT / ".gitignore").read_text().splitlines()
    several = Outputs("bench/results/spot_replay.json", "docs/img/spot_replay.png")
    assert several.target(parse(several, []), "spot_replay.png") == \
        results_path.LATEST / "spot_replay.png"


def test_out_is_honoured_file_or_folder(tmp_path: Path) -> None:
    one = Outputs("bench/results/streams.json")
    assert one.path(parse(one, ["--out", str(tmp_path / "a" / "s.json")])) == \
        tmp_path / "a" / "s.json"
    assert (tmp_path / "a").is_dir()
    several = Outputs("bench/results/validate.json", "bench/results/validate.png")
    paths = several.paths(parse(several, ["--out", str(tmp_path / "v")]))
    assert paths == {"validate.json": tmp_path / "v" / "validate.json",
                     "validate.png": tmp_path / "v" / "validate.png"}


def test_update_gives_the_committed_files_and_excludes_out() -> None:
    outputs = Outputs("bench/results/spot_replay.json", "docs/img/spot_replay.png")
    args = parse(outputs, ["--update"])
    assert outputs.target(args) == ROOT / "bench" / "results" / "spot_replay.json"
    assert outputs.target(args, "spot_replay.png") == ROOT / "docs" / "img" / "spot_replay.png"
    with pytest.raises(SystemExit):
        parse(outputs, ["--update", "--out", "x.json"])
    with pytest.raises(KeyError):
        outputs.target(args, "other.json")


def _docstrings(tree: ast.Module) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.FunctionDef | ast.ClassDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def _declared(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "OUTPUTS" for t in node.targets)
                and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Name) and node.value.func.id == "Outputs"):
            return [a.value for a in node.value.args if isinstance(a, ast.Constant)]
    return []


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_writes_only_through_the_helper(script: Path) -> None:
    source = script.read_text()
    tree = ast.parse(source)
    declared = _declared(tree)
    assert declared, f"{script.name}: no module-level OUTPUTS = Outputs(...)"
    for committed in declared:
        assert (ROOT / committed).is_file(), f"{script.name}: {committed} is not committed"
    assert "OUTPUTS.add_args(parser)" in source
    assert "wrote(" in source or "shown(" in source, f"{script.name} does not print the path"
    docstrings = _docstrings(tree)
    in_outputs = {id(a) for node in ast.walk(tree) if isinstance(node, ast.Call)
                  and isinstance(node.func, ast.Name) and node.func.id == "Outputs"
                  for a in node.args}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in docstrings | in_outputs:
            parts = node.value.replace("\\", "/").split("/")
            # a path into the committed results built by hand: "results", "bench/results/x"
            assert "results" not in parts and "img" not in parts, \
                f"{script.name}:{node.lineno}: {node.value!r} outside Outputs(...)"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "add_argument" and node.args \
                and isinstance(node.args[0], ast.Constant):
            assert node.args[0].value not in ("--out", "--update"), \
                f"{script.name}:{node.lineno}: {node.args[0].value} outside the helper"
