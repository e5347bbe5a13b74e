"""``MESHMORPH_FAULT`` (run/fault.py): what it parses, what it refuses, and the once-per-run
marker; no process is started."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshmorph.run import fault
from meshmorph.run.fault import FAULT_ENV, PHASES, Fault, parse_faults


def test_unset_or_empty_arms_nothing() -> None:
    assert parse_faults(None) == [] and parse_faults("") == [] and parse_faults("  ") == []


@pytest.mark.parametrize("phase", PHASES)
def test_every_phase_parses_to_a_sigkill(phase: str) -> None:
    assert parse_faults(f"1@3:{phase}") == [Fault(1, 3, phase)]


def test_pause_and_a_list_of_faults() -> None:
    assert parse_faults("0@4:checkpoint:pause=2.5, 1@2:reshape") == [
        Fault(0, 4, "checkpoint", 2.5), Fault(1, 2, "reshape")]


def test_any_rank_fires_on_every_rank_once_per_run_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "*@2:backward")
    (armed,) = fault.install(tmp_path)
    assert armed == Fault(None, 2, "backward")
    assert armed.marker(tmp_path) == tmp_path / ".fault-any-2-backward"
    for rank in ("0", "5"):
        monkeypatch.setenv("RANK", rank)
        assert fault._due("backward", 2) == [armed]
    armed.marker(tmp_path).write_text("1")
    assert fault._due("backward", 2) == []


@pytest.mark.parametrize("text", ["1@3", "1@0:forward", "x@3:forward", "1:forward", "@3:forward",
                                  "1@3:sideways", "1@3:forward:wait=2", "1@3:forward:pause=",
                                  "1@3:forward:pause=-1", "1@3:forward:pause=inf", "-1@3:forward", "**@3:forward"])
def test_malformed_values_are_refused_naming_the_form(text: str) -> None:
    with pytest.raises(ValueError, match=f"{FAULT_ENV} takes RANK@STEP:PHASE"):
        parse_faults(text)


def test_a_fault_is_due_on_its_rank_phase_and_step_until_its_marker_exists(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "1@3:optimizer:pause=0")
    monkeypatch.setenv("RANK", "1")
    armed = fault.install(tmp_path, [Fault(1, 2, "forward", marker_name=".failure-injected-1-2")])
    assert armed == [Fault(1, 3, "optimizer", 0.0), armed[1]]
    assert fault._due("optimizer", 3) == [armed[0]]
    assert fault._due("optimizer", 2) == [] and fault._due("backward", 3) == []
    fault.point("optimizer", 3)  # not a point phase, nothing fires: the hook does
    fault.fire(armed[0])  # the pause: a marker, then on
    assert (tmp_path / ".fault-1-3-optimizer").read_text().isdigit()
    assert fault._due("optimizer", 3) == []  # once per run folder
    assert fault._due("forward", 2) == [armed[1]]
    monkeypatch.setenv("RANK", "0")
    assert fault._due("forward", 2) == []
    monkeypatch.delenv(FAULT_ENV)
    assert fault.install(tmp_path) == []
