"""Flags taken from documented dataclasses: help from the field's docstring, default from the
field, and the parsed flags build back the dataclass's defaults."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import pytest

from meshmorph.cli.app import build_parser
from meshmorph.cli.flags import add_field, add_fields, config_from, field_docs
from meshmorph.profile.validate import ValidateConfig


class Colour(StrEnum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True)
class Options:
    """A sample configuration."""

    steps: int = 3
    """Training steps
    per run."""
    shift: int = 0
    """May be negative."""
    colour: Colour = Colour.RED
    """Paint."""
    out: Path | None = None
    """Where to write."""
    fast: bool = False
    """Go fast."""
    careful: bool = True
    """Check everything."""


def test_field_docs_read_each_fields_docstring_joined_on_one_line() -> None:
    assert field_docs(Options) == {"steps": "Training steps per run.", "shift": "May be negative.",
                                   "colour": "Paint.", "out": "Where to write.",
                                   "fast": "Go fast.", "careful": "Check everything."}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_fields(parser, Options, "steps", "shift", "colour", "out", "fast", careful="--skip-checks")
    return parser


def test_flags_parse_to_the_dataclass_defaults_and_back() -> None:
    assert config_from(_parser().parse_args([]), Options) == Options()
    args = _parser().parse_args(["--steps", "5", "--shift", "-2", "--colour", "blue", "--out",
                                 "x.json", "--fast", "--skip-checks"])
    assert config_from(args, Options) == Options(steps=5, shift=-2, colour=Colour.BLUE,
                                                 out=Path("x.json"), fast=True, careful=False)


def test_a_positive_default_refuses_zero_and_the_help_names_the_default(capsys) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["--steps", "0"])
    assert "must be at least 1" in capsys.readouterr().err
    text = _parser().format_help()
    assert "Training steps per run. (default 3)" in " ".join(text.split())


def test_an_enum_field_offers_its_values_only(capsys) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["--colour", "green"])
    assert "invalid choice" in capsys.readouterr().err


def test_an_unknown_field_is_a_key_error() -> None:
    with pytest.raises(KeyError, match="no field 'nope'"):
        add_field(argparse.ArgumentParser(), Options, "nope")


def test_validate_without_flags_is_validate_config_defaults() -> None:
    args = build_parser().parse_args(["validate"])
    assert config_from(args, ValidateConfig) == ValidateConfig()


def test_a_profile_too_large_for_memory_is_refused_before_any_process(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from meshmorph.cli import main

    code = main(["profile", "--seq-len", "100000", "--out", str(tmp_path / "p.json")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("meshmorph: error: timing a block of gpt-small"), err
    assert err.count("\n") == 1 and "lower --seq-len or --nproc" in err
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("argv", [
    ["validate", "--json", "{dir}"], ["validate", "--png", "{missing}/x/y.png"],
    ["timeline", "--schedule", "1f1b", "--pp", "2", "--microbatches", "4", "--png", "{dir}"],
    ["profile", "--out", "{dir}"], ["streams", "--model", "resnet-stack", "--png", "{dir}"],
    ["models", "--json", "{dir}"],
])
def test_every_output_path_is_checked_before_any_work(
        tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch,
        argv: list[str]) -> None:
    from meshmorph.cli import main

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("work started although an output path was bad")

    monkeypatch.setattr("subprocess.Popen", refuse)
    monkeypatch.setattr("multiprocessing.get_context", refuse)
    blocker = tmp_path / "file"
    blocker.write_text("")
    argv = [a.format(dir=tmp_path, missing=blocker) for a in argv]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "is a folder; pass a file path" in err or "is not a folder" in err
