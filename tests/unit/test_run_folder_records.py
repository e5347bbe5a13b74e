"""A run folder's records: a new run sets an earlier run's aside, a resumed run keeps only the
history up to its checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

from meshmorph.run.launch.run_folder import set_aside_earlier_run
from meshmorph.run.metrics import truncate_metrics


def test_a_new_run_moves_an_earlier_runs_records_aside(tmp_path: Path) -> None:
    assert set_aside_earlier_run(tmp_path) is None  # an empty folder: nothing to move
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    (tmp_path / "plan.json").write_text("{}\n")
    (tmp_path / "logs").mkdir()
    (tmp_path / "job.toml").write_text("# the user's\n")
    aside = set_aside_earlier_run(tmp_path)
    assert aside == tmp_path / "earlier-1"
    assert sorted(p.name for p in aside.iterdir()) == ["logs", "metrics.jsonl", "plan.json"]
    assert (tmp_path / "job.toml").exists() and not (tmp_path / "metrics.jsonl").exists()
    (tmp_path / "plan.json").write_text("{}\n")
    assert set_aside_earlier_run(tmp_path) == tmp_path / "earlier-2"  # the next free number


def test_a_resume_keeps_the_steps_and_events_up_to_its_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    lines = [{"step": 1}, {"event": "state", "after_step": 1, "ranks": []}, {"step": 2},
             {"event": "reshape", "at_step": 2}, {"step": 3}, {"step": 4},
             {"event": "reshape", "at_step": 4}, {"event": "state", "ranks": []}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 5, "lo')
    truncate_metrics(path, 3)
    kept = [json.loads(line) for line in path.read_text().splitlines()]
    assert kept == lines[:5]  # the later steps and events, a stepless event and a cut line go
