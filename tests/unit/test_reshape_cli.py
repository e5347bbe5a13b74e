"""``meshmorph reshape``: the dry run prints and writes the MovePlan's figures, and refuses bad
input with one line naming the constraint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshmorph.cli import main
from meshmorph.elastic.moves.layout import layout_of
from meshmorph.elastic.moves.move_plan import plan_move
from meshmorph.elastic.moves.move_time import predict_move_time_s
from meshmorph.spec.catalog import load_model
from meshmorph.spec.cluster import parse_cluster
from meshmorph.spec.plan import Plan, load_plan

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "plans"
FROM, TO = EXAMPLES / "reshape-zero3-dp4.json", EXAMPLES / "reshape-tp2-pp2.json"


def _write(path: Path, model: str, **kw: object) -> Path:
    spec = load_model(model, 32)
    path.write_text(Plan(model=model, seq_len=32, **kw).with_even_stages(spec).to_json())  # type: ignore[arg-type]
    return path


def test_example_reshape_json_holds_the_move_plans_figures(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "move.json", tmp_path / "move.png"
    assert main(["reshape", "--from", str(FROM), "--to", str(TO), "--json", str(out),
                 "--png", str(png)]) == 0
    data = json.loads(out.read_text())
    a, b = load_plan(FROM), load_plan(TO)
    model = load_model(a.model, a.seq_len)
    move = plan_move(layout_of(model, a), layout_of(model, b), [0, 1, 2, 3])
    assert data["bytes_moved"] == data["lower_bound_bytes"] == move.lower_bound_bytes == 35835776
    assert data["naive_bytes"] == data["naive"]["bytes_moved"] == 44508672
    assert data["busiest_device_bytes"] == move.busiest_device_bytes
    assert data["predicted_time_s"] == pytest.approx(
        predict_move_time_s(move, parse_cluster("cpu:1x4")), rel=1e-12)
    assert sum(link["bytes"] for link in data["links"]) == data["network_bytes"] == 35835776
    printed = capsys.readouterr().out
    assert "rank order" in printed and "34.18 MiB" in printed and "42.45 MiB" in printed
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_lost_rank_shows_its_pieces_coming_from_the_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "move.json"
    assert main(["reshape", "--from", str(FROM), "--to", str(TO), "--survivors", "0,1,3",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["checkpoint_bytes"] > 0 and data["from_checkpoint"]
    assert data["bytes_moved"] == data["lower_bound_bytes"] <= data["naive_bytes"]
    assert [d["device"] for d in data["devices"]] == [0, 1, 3, 4]


@pytest.mark.parametrize(("argv", "message"), [
    (["--survivors", "0,7"], "survivors [7] are outside the old plan's ranks 0..3"),
    (["--survivors", "0,0"], "list a rank twice"),
])
def test_bad_survivors_are_one_line_errors(argv: list[str], message: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["reshape", "--from", str(FROM), "--to", str(TO), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.parametrize("value", ["nan", "-1", "0", "inf"])
def test_a_staging_buffer_that_is_not_a_positive_size_is_refused(
        value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["reshape", "--from", str(FROM), "--to", str(TO), "--staging-mib", value])
    assert exited.value.code == 2
    assert f"--staging-mib: must be a finite number > 0, got {value}" in capsys.readouterr().err


def test_plans_for_different_models_are_refused(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    other = _write(tmp_path / "llama.json", "llama-tiny", dp=4, global_batch=8, num_microbatches=2)
    assert main(["reshape", "--from", str(FROM), "--to", str(other)]) == 2
    err = capsys.readouterr().err
    assert "keeps the model" in err and err.count("\n") == 1


def test_a_target_that_does_not_fit_memory_is_refused_before_anything_moves(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _write(tmp_path / "a.json", "gpt3-1.3b", dp=2, zero=3, global_batch=2)
    b = _write(tmp_path / "b.json", "gpt3-1.3b", dp=1, global_batch=2, num_microbatches=2)
    out = tmp_path / "move.json"
    assert main(["reshape", "--from", str(a), "--to", str(b), "--cluster", "cpu:1x2",
                 "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert "does not fit memory" in err and "the device has 4.0 GiB" in err
    assert not out.exists()


def test_a_profile_prices_the_move_with_its_measured_point_to_point_fit(tmp_path: Path) -> None:
    from meshmorph.cost.profile import Profile
    from meshmorph.elastic.moves.move_time import MoveTimeModel

    profile = tmp_path / "profile.json"
    Profile(collectives={"send_recv/2": {"alpha_s": 1e-3, "beta_s_per_byte": 1e-9, "r2": 1.0}}
            ).save(profile)
    out = tmp_path / "move.json"
    assert main(["reshape", "--from", str(FROM), "--to", str(TO), "--profile", str(profile),
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    a, b = load_plan(FROM), load_plan(TO)
    model = load_model(a.model, a.seq_len)
    move = plan_move(layout_of(model, a), layout_of(model, b), [0, 1, 2, 3])
    measured = MoveTimeModel(p2p_alpha_s=1e-3, p2p_beta_s_per_byte=1e-9)
    assert data["predicted_time_s"] == pytest.approx(
        predict_move_time_s(move, parse_cluster("cpu:1x4"), model=measured), rel=1e-12)
    assert data["predicted_time_s"] > predict_move_time_s(move, parse_cluster("cpu:1x4"))
