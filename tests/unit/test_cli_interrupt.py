"""Ctrl-C at any moment of the command line's start ends it in one line, exit 130."""

from __future__ import annotations

import pytest

from meshmorph.cli import app


def test_ctrl_c_while_the_subcommands_import_is_one_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    def interrupted(name: str) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(app.importlib, "import_module", interrupted)
    assert app.main(["models"]) == 130
    captured = capsys.readouterr()
    assert captured.err == "meshmorph: interrupted\n" and captured.out == ""
