"""``estimate`` sets the overlap switches from its flags and prices them; its headline, the
``plan`` table and ``--json`` show them."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from meshmorph.cli import main

ZERO3 = ["estimate", "--model", "gpt3-1.3b", "--cluster", "a100-80g:1x8", "--tp", "1", "--pp",
         "1", "--dp", "8", "--zero", "3", "--global-batch", "16"]


def _run(args: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(args) == 0
    return out.getvalue()


def test_estimate_flags_set_the_switches_and_price_them(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    steps = {}
    for name, flags in (("on", []), ("no-pf", ["--no-fsdp-prefetch"]),
                        ("no-grad", ["--no-overlap-grad-reduce"])):
        path = tmp_path / f"{name}.json"
        text = _run([*ZERO3, *flags, "--json", str(path)])
        plan = json.loads(path.read_text())
        assert plan["fsdp_prefetch"] is (name != "no-pf")
        assert plan["overlap_grad_reduce"] is (name != "no-grad")
        assert plan["tp_comm_overlap"] is False
        assert ("overlap " + {"on": "grad pf", "no-pf": "grad no-pf",
                              "no-grad": "no-grad pf"}[name]) in text
        steps[name] = plan["predicted"]["step_time_s"]
    assert steps["on"] < steps["no-pf"] and steps["on"] < steps["no-grad"]


def test_plan_table_has_an_overlap_column() -> None:
    """``--wide`` shows it; at 100 columns it is named among the columns left out."""
    args = ["plan", "--model", "gpt3-1.3b", "--cluster", "a100-80g:1x4", "--global-batch", "8",
            "--top", "2"]
    wide = _run([*args, "--wide"])
    assert "overlap" in wide.splitlines()[2] and "grad" in wide
    assert "left out to fit 100 columns: overlap" in _run(args)
