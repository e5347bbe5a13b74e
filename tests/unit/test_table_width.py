"""Every table a subcommand prints fits 100 columns, on a terminal and piped to a file, without a
cell cut short (``…``) and with its key columns (cp, MFU, step time) shown; ``--wide`` shows every
column with its full header (meshmorph.tables)."""

from __future__ import annotations

import re

import pytest
from rich.cells import cell_len
from rich.console import Console

from meshmorph.cli.app import main
from meshmorph.cli.catalogs import GPU_COLUMNS, MODEL_COLUMNS
from meshmorph.cli.reshape import DEVICE_COLUMNS, PLACEMENT_COLUMNS
from meshmorph.cli.simulate import ZONE_COLUMNS
from meshmorph.cli.streams import STREAM_COLUMNS
from meshmorph.cli.validate import VALIDATE_COLUMNS, report
from meshmorph.plan.report import MEMORY_COLUMNS, plan_columns
from meshmorph.tables import TABLE_WIDTH, Column, fit_table, report_console

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")

CP_PLAN = ["plan", "--model", "llama3-8b", "--seq-len", "131072", "--cluster", "h100:8x8",
           "--global-batch", "16", "--top", "3"]

COMMANDS = {
    # name: (argv, texts the 100-column output shows, full headers --wide adds)
    "plan": (CP_PLAN, ["cp", "MFU", "step", "tp pp dp", "GiB"],
             [c.header for c in plan_columns(True)]),
    "estimate": (["estimate", "--plan", "examples/plans/megatron-gpt3-175b.json", "--cluster",
                  "a100-80g:96x8"], ["step", "MFU", "total", "budget"],
                 [c.header for c in MEMORY_COLUMNS]),
    "models": (["models"], ["gpt3-175b", "params (B)"], [c.header for c in MODEL_COLUMNS]),
    "gpus": (["gpus"], ["h100", "bf16", "latency us"], [c.header for c in GPU_COLUMNS]),
    "reshape": (["reshape", "--from", "examples/plans/reshape-zero3-dp4.json", "--to",
                 "examples/plans/reshape-tp2-pp2.json"], ["0->0 1->2 2->1 3->3", "34.18 MiB"],
                [c.header for c in (*DEVICE_COLUMNS, *PLACEMENT_COLUMNS)]),
    "simulate": (["simulate", "--model", "gpt3-1.3b", "--tokens", "1e9", "--cluster", "h100:2x8",
                  "--spot", "--runs", "2", "--deadline", "10", "--trace", "h100-gcp-2025-10"],
                 ["restart", "trace", "on-demand"],
                 [c.header for c in ZONE_COLUMNS] + ["zones used (share of training)",
                                                     "met deadline", "nodes lost"]),
    "streams": (["streams", "--model", "inception-stack"], ["stream", "first op", "after op"],
                [c.header for c in STREAM_COLUMNS] + ["before op"]),
    "advise": (["advise", "--model", "gpt-small", "--tokens", "1e8", "--runs", "1"],
               ["recommended (*)", "tp/pp/dp"], ["time h (P90)", "cost $ (P90)"]),
}


def _lines(text: str) -> list[str]:
    return ANSI.sub("", text).splitlines()


def _check_fits(text: str) -> None:
    lines = _lines(text)
    widest = max(lines, key=cell_len)
    assert cell_len(widest) <= TABLE_WIDTH, f"{cell_len(widest)} columns: {widest!r}"
    assert "…" not in text, "a cell was cut short"


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("name", list(COMMANDS))
def test_tables_fit_100_columns_piped_and_wide_shows_every_column(
        name: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "240")  # piped: the width of the environment does not matter
    argv, shown, full_headers = COMMANDS[name]
    text = _run(argv, capsys)
    _check_fits(text)
    for needed in shown:
        assert needed in text, f"{needed!r} missing from {name} at 100 columns"
    wide = _run([*argv, "--wide"], capsys)
    if name == "plan":  # every column of the cp plans, one line each
        assert max(cell_len(line) for line in _lines(wide)) > TABLE_WIDTH
    assert "…" not in wide and "left out to fit" not in wide
    for header in full_headers:
        assert header in wide, f"--wide lacks {header!r}"


@pytest.mark.parametrize("columns", ["160", "100"])
def test_on_a_terminal_the_plans_table_fits_100_columns_with_cp_mfu_and_step(
        columns: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", columns)
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich treats the captured stream as a terminal
    assert report_console().is_terminal and report_console().width == TABLE_WIDTH
    text = _run(CP_PLAN, capsys)
    _check_fits(text)
    header = next(line for line in _lines(text) if line.startswith("#"))
    assert {"cp", "MFU", "step"} <= set(header.split())
    assert "left out to fit 100 columns: overlap" in ANSI.sub("", text)


def test_piped_console_is_100_columns_and_wide_console_is_unbounded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "240")
    console = report_console()
    assert not console.is_terminal and console.width == TABLE_WIDTH
    assert report_console(wide=True).width > 1000


def test_validate_wraps_a_long_plan_name_instead_of_cutting_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    name = "tp1pp1dp2zero1-mb2x4-interleaved-v2-recompute-full"
    row = {"name": name, "measured_step_s": 0.5, "predicted_step_s": 0.55,
           "predicted_low_s": 0.5, "predicted_high_s": 0.6, "state_bytes_rank0": 2**22,
           "predicted_state_bytes_rank0": 2**22, "outside_profile": ["layer sizes not profiled"]}
    result = {"model": "gpt-tiny", "seq_len": 64, "nproc": 2, "plans": [row] * 3, "mape": 10.0,
              "kendall_tau": 1.0, "in_range": 3, "load_avg_profile": 0.5, "cores": 2}
    report(result, json_path=None, png_path=None)
    text = capsys.readouterr().out
    _check_fits(text)
    assert name[:30] in text and name[30:] in text  # wrapped, every character shown
    report(result, json_path=None, png_path=None, wide=True)
    wide = capsys.readouterr().out
    assert name in wide
    for column in VALIDATE_COLUMNS:
        assert column.header in wide


def test_columns_are_left_out_highest_drop_first_and_named() -> None:
    console = Console(width=40, file=None, highlight=False)
    columns = [Column("key"), Column("a" * 12, drop=1), Column("b" * 12, drop=2),
               Column("c" * 12, "c")]
    fitted = fit_table(console, columns, [["1", "x", "y", "z"]])
    assert fitted.left_out == ["b" * 12]  # the highest drop goes first; "c" shortens instead
    assert fitted.width <= 40
    with pytest.raises(ValueError, match="3 cells for 4 columns"):
        fit_table(console, columns, [["1", "2", "3"]])
