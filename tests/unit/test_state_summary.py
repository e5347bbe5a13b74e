"""The console line that sums up the state line: the largest measured-vs-predicted gap, named."""

from __future__ import annotations

from meshmorph.run.engine.state_line import state_summary


def _record(rank: int, params: int, sent: int, predicted_sent: int) -> dict[str, object]:
    held = {"params_bytes": params, "grads_bytes": params, "optimizer_bytes": 2 * params}
    return {"rank": rank,
            "measured": {**held, "comm_bytes": {"all_reduce": sent}},
            "predicted": {**held, "comm_bytes": {"all_reduce": predicted_sent}}}


def test_summary_names_the_rank_and_figure_with_the_largest_gap() -> None:
    records = [_record(0, 2**20, 1000, 1000), _record(1, 2**20, 1030, 1000)]
    line = state_summary(records)
    assert "2 ranks hold 8.0 MiB" in line
    assert "largest gap 3.00% (rank 1, all_reduce bytes: measured 1,030 vs 1,000)" in line


def test_summary_of_an_exact_prediction_reports_no_gap() -> None:
    line = state_summary([_record(0, 4096, 64, 64)])
    assert line.endswith('largest gap 0.00% (metrics.jsonl "state" line)')


def test_a_restored_engine_names_the_step_it_measured_after() -> None:
    assert state_summary([_record(0, 4096, 64, 64)]).startswith("state after step 1: 1 ranks")
    assert state_summary([_record(0, 4096, 64, 64)], 4).startswith("state after step 4: ")
