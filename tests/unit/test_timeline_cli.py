"""``meshmorph timeline``: the printed figures, the Chrome trace (one complete event per action,
pid/tid per rank), the PNG, plan files priced exactly as the cost model prices them, and
``--compare`` over a run folder's trace."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from meshmorph.cli import main
from meshmorph.cost.model import CostModel
from meshmorph.cost.pipeline import simulate
from meshmorph.schedule.simulator import StageTimes, simulate_schedule
from meshmorph.schedule.trace import read_trace_ops, timeline_events, write_trace
from meshmorph.spec import catalog_model, parse_cluster
from meshmorph.spec.plan import load_plan
from meshmorph.viz.timeline_chart import plan_timeline

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "plans" / "megatron-gpt3-175b.json"


def test_quick_look_prints_step_bubble_and_peaks_and_writes_trace_and_png(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png, trace = tmp_path / "t.png", tmp_path / "t.json"
    assert main(["timeline", "--schedule", "1f1b", "--pp", "4", "--microbatches", "8",
                 "--png", str(png), "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    # (m + p - 1)(F + B) = 11 x 3 ms; idle (p - 1)/(m + p - 1) = 3/11
    assert "step 33.000 ms  bubble 27.3%  peak activations per rank 4 3 2 1" in out
    events = json.loads(trace.read_text())["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == 4 * 8 * 2  # one per F and B of every rank and micro-batch
    assert all(e["pid"] == e["tid"] == e["args"]["rank"] for e in complete)
    assert sorted({e["pid"] for e in complete}) == [0, 1, 2, 3]
    assert max(e["ts"] + e["dur"] for e in complete) == pytest.approx(33_000.0)
    head = png.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", head[16:24])[0] == 1440  # 12 in at 120 dpi


@pytest.mark.parametrize("name,expected", [("zb", "step 27.000 ms  bubble 11.1%"),
                                           ("zbv", "step 25.500 ms  bubble 5.9%"),
                                           ("gpipe", "step 33.000 ms  bubble 27.3%")])
def test_quick_look_of_each_schedule_on_uniform_stages(name: str, expected: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["timeline", "--schedule", name, "--pp", "4", "--microbatches", "8"]) == 0
    assert expected in capsys.readouterr().out


def test_plan_timeline_is_the_cost_models_simulation_bit_for_bit() -> None:
    plan = load_plan(EXAMPLE)
    cost = CostModel(catalog_model(plan.model).with_seq_len(plan.seq_len),
                     parse_cluster("a100-80g:128x8"))
    drawn = plan_timeline(plan, cost)
    gpus = [cost.stage_gpu(s) for s in plan.stages]
    times = [cost.chunk_time(plan, s.start, s.stop, s.recompute, g)
             for s, g in zip(plan.stages, gpus, strict=True)]
    priced = simulate(plan.schedule, plan.pp, plan.num_microbatches, [t.fwd_s for t in times],
                      [t.bwd_s for t in times], v=plan.vpp,
                      p2p_s=[cost.p2p_time(plan, g) for g in gpus])
    assert drawn.makespan_s == priced.makespan_s
    assert drawn.rank_end_s == priced.rank_end_s


def test_plan_without_a_cluster_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["timeline", "--plan", str(EXAMPLE)]) == 2
    assert "does not name its cluster; pass --cluster" in capsys.readouterr().err


def test_missing_shape_is_refused_with_the_ways_to_call_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["timeline", "--schedule", "1f1b", "--pp", "4"]) == 2
    assert "--schedule NAME --pp P --microbatches M" in capsys.readouterr().err


def test_compare_simulates_the_run_from_its_own_action_times(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # a "measured" trace that is itself a simulation with unequal stages: the overlay's
    # simulation from the median action times must give back the same step time
    times = StageTimes([1e-3, 2e-3, 1e-3], [2e-3, 4e-3, 3e-3])
    measured = simulate_schedule("1f1b", 3, 6, times)
    write_trace(tmp_path / "trace.json", timeline_events(measured.ops), schedule="1f1b", pp=3,
                microbatches=6, vpp=1, steps=1)
    png = tmp_path / "compare.png"
    assert main(["timeline", "--compare", str(tmp_path), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    ms = measured.makespan_s * 1e3
    assert f"simulated {ms:.3f} ms per step, measured {ms:.3f} ms per step" in out
    assert png.read_bytes()[:4] == b"\x89PNG"
    back = read_trace_ops(tmp_path / "trace.json")
    assert len(back) == len(measured.ops) == 3 * 6 * 2


@pytest.mark.parametrize("args,message", [
    (["--schedule", "dualpipev", "--pp", "4", "--microbatches", "4"],
     "dualpipev needs at least 2 x pp = 8 micro-batches, got 4"),
    (["--schedule", "interleaved", "--pp", "4", "--microbatches", "9", "--vpp", "2"],
     "split into 2 equal rounds"),
    (["--compare", "no-such-run-folder"], "write one with 'meshmorph run --trace'"),
])
def test_bad_timeline_arguments_get_one_line_errors(args: list[str], message: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["timeline", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_timeline_too_large_to_read_is_refused_in_a_second(capsys: pytest.CaptureFixture,
                                                             tmp_path: Path) -> None:
    code = main(["timeline", "--schedule", "1f1b", "--pp", "100000", "--microbatches", "100000",
                 "--png", str(tmp_path / "t.png")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "10,000,000,000 (stage, micro-batch) pairs is above the 65,536 a readable chart" in err
    assert not (tmp_path / "t.png").exists()


def test_the_schedule_library_refuses_lists_that_would_take_minutes() -> None:
    from meshmorph.schedule.one_f_one_b import ScheduleShapeError
    from meshmorph.schedule.registry import MAX_PAIRS, schedule_actions

    with pytest.raises(ScheduleShapeError, match="lower pp or the micro-batch count"):
        schedule_actions("interleaved", 64, MAX_PAIRS // 128 + 64, 2)
