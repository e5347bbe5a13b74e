"""``meshmorph run --trace`` on 4 real gloo processes: the recorded per-rank timeline is exactly
meshmorph's action list for the schedule (torch's runtime runs it in that order), the actions of
a rank never overlap, and ``meshmorph timeline --compare`` reads it back.

A part of the 4-process ``world4`` job trains gpt-tiny with pp 4 under 1F1B and under ZB-H1 (input- and weight-gradient
backwards timed apart), tracing steps 2 and 3 of each through ``run.pipeline.RunTrace``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshmorph.cli import main
from meshmorph.schedule import schedule_actions
from meshmorph.schedule.trace import read_trace_ops
from meshmorph.spec.model import ModelSpec
from tests.helpers.world import Part, part_folder

PP, M, STEPS = 4, 4, 3
SCHEDULES = ("1f1b", "zb")


def trace_part(rank: int, world: int, out: Path) -> None:
    import os

    from meshmorph.schedule.trace import TRACE_ENV
    from meshmorph.spec import catalog_model

    spec = catalog_model("gpt-tiny").with_seq_len(16)
    before = os.environ.get(TRACE_ENV)
    os.environ[TRACE_ENV] = "2"
    try:
        _trace_schedules(spec, out)
    finally:  # the world's later parts run untraced
        if before is None:
            del os.environ[TRACE_ENV]
        else:
            os.environ[TRACE_ENV] = before


def _trace_schedules(spec: ModelSpec, out: Path) -> None:
    import torch

    from meshmorph.run.config import OptimConfig
    from meshmorph.run.engine.pipeline import RunTrace
    from meshmorph.run.engine.train_engine import build_engine
    from meshmorph.spec.plan import Plan

    for name in SCHEDULES:
        plan = Plan(model=spec.name, seq_len=16, dtype="fp32", micro_batch=1, num_microbatches=M,
                    global_batch=M, pp=PP, schedule=name).with_even_stages(spec)
        engine = build_engine(spec, plan, OptimConfig(), seed=0, device=torch.device("cpu"))
        folder = Path(out) / name
        trace = RunTrace.from_env(engine.schedule, plan, folder, STEPS)
        assert trace is not None
        gen = torch.Generator().manual_seed(0)
        for _ in range(STEPS):
            tokens = torch.randint(0, spec.vocab_size, (M, 17), generator=gen)
            trace.before_step()
            engine.step(tokens)
            trace.after_step()


WORLD_PARTS = [Part("run_trace", trace_part, world=PP, timeout_s=90)]


@pytest.mark.dist
@pytest.mark.timeout(60, func_only=True)
def test_run_trace_records_meshmorphs_action_order_per_rank_and_compare_reads_it(
        world4: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = part_folder(world4, "run_trace")
    for name in SCHEDULES:
        path = folder / name / "trace.json"
        meta = json.loads(path.read_text())
        assert (meta["schedule"], meta["pp"], meta["microbatches"], meta["steps"]) == \
            (name, PP, M, 2)
        ops = read_trace_ops(path)
        expected = [[str(a) for a in order] for order in schedule_actions(name, PP, M)]
        per_step = sum(len(order) for order in expected)
        assert len(ops) == 2 * per_step  # steps 2 and 3: every action of every rank, once
        for rank in range(PP):
            mine = sorted((op for op in ops if op[0] == rank), key=lambda op: op[4])
            assert [f"{s}{k}{j}" for _, k, s, j, _, _ in mine] == expected[rank] * 2, (name, rank)
            assert all(a[5] <= b[4] for a, b in zip(mine, mine[1:], strict=False)), (name, rank)
        assert main(["timeline", "--compare", str(folder / name)]) == 0
        out = capsys.readouterr().out
        assert out.startswith("simulated ") and " ms per step, measured " in out
