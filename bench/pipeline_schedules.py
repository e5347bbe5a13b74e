"""Pipeline schedules on 4 gloo processes: measured step time beside the simulator's prediction.

GPipe, 1F1B, ZB-H1, interleaved 1F1B (two chunks per rank) and asynchronous 1F1B run a stack of
MLP blocks split over 4 pipeline ranks, with equal stages (2 blocks per rank) and unequal ones
(2, 2, 2, 4). Each synchronous schedule is meshmorph's own action list executed by torch
pipelining's runtime for action lists (``run.pipeline.action_list_schedule``); async runs in
meshmorph's asynchronous executor (``run.async_pipeline.AsyncPipeline``, stale weights, momentum
SGD stepping after every backward) for ``warmup + steps`` steps of ``m`` micro-batches without a
flush, and its measured step is the median time between the last stage's ends of consecutive
steps after the warm-up (its fill is paid once, not per step). Every action of the measured steps is timed on its rank
(``run.pipeline.ActionRecorder``); the simulated step is ``meshmorph.schedule``'s event simulator
fed with the per-stage median F, B, I and W times of the same run (transfers as 0; for async:
``cost.pipeline.async_steady_step`` over its own F, B and optimizer-step times), so the gap
between the two columns is what the simulator leaves out: send/receive waits, Python overhead
between actions, and (on a 2-core machine) 4 single-threaded ranks sharing 2 cores.

Run: ``python bench/pipeline_schedules.py [--steps N]``; writes
bench/results/latest/pipeline_schedules.json (``--out PATH`` to choose, ``--update`` for the
committed bench/results/pipeline_schedules.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.helpers: the spawn harness

from tests.helpers.spawn import spawn  # noqa: E402

from results_path import Outputs, wrote  # noqa: E402

OUTPUTS = Outputs("bench/results/pipeline_schedules.json")

SCHEDULES = ("gpipe", "1f1b", "zb", "interleaved", "async")
LAYOUTS = {"equal": (2, 2, 2, 2), "unequal": (2, 2, 2, 4)}
"""MLP blocks per pipeline rank (interleaved: split in half over the rank's two chunks)."""


def _worker(rank: int, world: int, config: dict, out_path: str) -> None:
    import time

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage

    from meshmorph.run.engine.pipeline import ActionRecorder, action_list_schedule
    from meshmorph.schedule.simulator import StageTimes, simulate_schedule

    hidden, rows, m = config["hidden"], config["micro_batch"], config["microbatches"]
    rows_out = []
    for layout, blocks in LAYOUTS.items():
        for name in SCHEDULES:
            if name == "async":  # priced with the 1F1B run's compute medians (rank 0 has them)
                sync = [next(([r["stage_fwd_s"], r["stage_bwd_s"]] for r in rows_out
                              if r["layout"] == layout and r["schedule"] == "1f1b"), None)]
                dist.broadcast_object_list(sync, src=0)
                row = _async_row(rank, world, config, layout, blocks, *sync[0])
                if rank == world - 1:
                    rows_out.append(row)
                continue
            v = 2 if name == "interleaved" else 1
            torch.manual_seed(0)
            stages, ids = [], [rank + k * world for k in range(v)]
            for sid in ids:
                n = blocks[sid % world] // v
                module = nn.Sequential(*[nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh())
                                         for _ in range(n)])
                stages.append(PipelineStage(module, sid, world * v, torch.device("cpu"),
                                            # requires_grad: the gradient travels back
                                            input_args=torch.empty(rows, hidden,
                                                                   requires_grad=sid > 0),
                                            output_args=torch.empty(rows, hidden,
                                                                    requires_grad=True)))
            schedule = action_list_schedule(stages, name, m, nn.functional.mse_loss)
            recorder = ActionRecorder()
            for stage in stages:
                recorder.wrap(stage)
            x, y = torch.randn(rows * m, hidden), torch.randn(rows * m, hidden)
            first, last = 0 in ids, world * v - 1 in ids
            step_s: list[float] = []
            records: list = []
            for step in range(config["warmup"] + config["steps"]):
                for stage in stages:
                    stage.submod.zero_grad(set_to_none=True)
                dist.barrier()
                recorder.start()
                start = time.perf_counter()
                schedule.step(*([x] if first else []), **({"target": y} if last else {}))
                dist.barrier()
                elapsed = time.perf_counter() - start
                if step >= config["warmup"]:
                    step_s.append(elapsed)
                    records += [(rank, *r) for r in recorder.stop()]
            gathered: list = [None] * world if rank == 0 else []
            dist.gather_object(records, gathered if rank == 0 else None, dst=0)
            if rank != 0:
                continue
            ops = [op for part in gathered for op in part]
            stages_n = world * v

            def median(kind: str, ops: list = ops, stages_n: int = stages_n) -> list[float]:
                return [statistics.median([e - s for _, k, st, _, s, e in ops
                                           if k == kind and st == sid] or [0.0])
                        for sid in range(stages_n)]

            f, b, i, w = median("F"), median("B"), median("I"), median("W")
            full = [bb or ii + ww for bb, ii, ww in zip(b, i, w, strict=True)]
            times = StageTimes(f, full, igrad_s=[ii or bb for ii, bb in zip(i, full, strict=True)],
                               wgrad_s=w)
            sim = simulate_schedule(name, world, m, times, v=v, keep_ops=False)
            measured = statistics.median(step_s)
            busy = sum(e - s for *_, s, e in ops) / config["steps"]
            rows_out.append({
                "layout": layout, "blocks_per_rank": list(blocks), "schedule": name, "vpp": v,
                "measured_step_s": measured, "simulated_step_s": sim.makespan_s,
                "simulated_over_measured": sim.makespan_s / measured,
                "measured_bubble": 1 - busy / (world * measured),
                "simulated_bubble": sim.bubble_fraction,
                "stage_fwd_s": f, "stage_bwd_s": full, "stage_igrad_s": i, "stage_wgrad_s": w,
                "measured_steps_s": step_s})
    # the async rows were measured on the last rank, the others on rank 0
    gathered_rows: list = [None] * world if rank == 0 else []
    dist.gather_object(rows_out, gathered_rows if rank == 0 else None, dst=0)
    if rank == 0:
        rows_all = [row for part in gathered_rows for row in part]
        order = {(lay, name): i for i, (lay, name) in enumerate(
            (lay, name) for lay in LAYOUTS for name in SCHEDULES)}
        rows_all.sort(key=lambda row: order[row["layout"], row["schedule"]])
        Path(out_path).write_text(json.dumps(rows_all))


def _async_row(rank: int, world: int, config: dict, layout: str, blocks: tuple[int, ...],
               f: list[float], b: list[float]) -> dict:
    """Asynchronous 1F1B on this rank's stage: measured steady-state step, and the simulator's
    steady state fed with the 1F1B run's per-stage F and B medians (``f``, ``b``: compute only,
    where the async executor's forward also holds its blocking receive) and this run's
    optimizer-step medians."""
    import time

    import torch
    import torch.distributed as dist
    from torch import nn

    from meshmorph.cost.pipeline import async_steady_step
    from meshmorph.run.async_pipe.config import AsyncPipelineConfig
    from meshmorph.run.async_pipe.executor import AsyncPipeline

    hidden, rows, m = config["hidden"], config["micro_batch"], config["microbatches"]
    steps = config["warmup"] + config["steps"]
    torch.manual_seed(0)
    module = nn.Sequential(*[nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh())
                             for _ in range(blocks[rank])])
    pipeline = AsyncPipeline(module, AsyncPipelineConfig(weight_prediction="none", lr=1e-3,
                                                         guard_threshold=None),
                             feature_shapes=[(hidden,)] * world, loss_fn=nn.functional.mse_loss)
    spans: dict[str, list[tuple[float, float]]] = {"STEP": []}

    def timed(kind: str, method):  # type: ignore[no-untyped-def]
        def run(*args, **kwargs):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            out = method(*args, **kwargs)
            spans[kind].append((start, time.perf_counter()))
            return out
        return run

    pipeline.weights.step = timed("STEP", pipeline.weights.step)  # type: ignore[method-assign]
    data = [(torch.randn(rows, hidden), torch.randn(rows, hidden)) for _ in range(m)]
    ends: list[float] = []
    pipeline.train(lambda i: data[i % m], steps * m, rows,
                   on_loss=lambda i, loss: ends.append(time.perf_counter()))
    steps_s: list = [None] * world
    dist.all_gather_object(steps_s, statistics.median(e - s for s, e in spans["STEP"]))
    result: dict = {}
    if rank == world - 1:
        step_ends = ends[m - 1::m]
        measured_steps = [later - earlier for earlier, later in zip(
            step_ends[config["warmup"] - 1:-1], step_ends[config["warmup"]:], strict=True)]
        result = {"steps": measured_steps}
    shared = [result]
    dist.broadcast_object_list(shared, src=world - 1)
    measured_steps = shared[0]["steps"]
    opt = [float(t) for t in steps_s]
    sim = async_steady_step(world, m, f, b, step_s=opt)
    measured = statistics.median(measured_steps)
    # compute per step (the executor's forward also holds its blocking receive, so the busy
    # share is the compute medians' m x (F + B + STEP) per rank, as the other rows' spans are)
    busy = sum(m * (ff + bb + tt) for ff, bb, tt in zip(f, b, opt, strict=True))
    return {"layout": layout, "blocks_per_rank": list(blocks), "schedule": "async", "vpp": 1,
            "measured_step_s": measured, "simulated_step_s": sim.makespan_s,
            "simulated_over_measured": sim.makespan_s / measured,
            "measured_bubble": 1 - busy / (world * measured),
            "simulated_bubble": sim.bubble_fraction,
            "stage_fwd_s": f, "stage_bwd_s": b, "stage_step_s": opt,
            "measured_steps_s": measured_steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="measured steps per schedule")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps first")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=128, help="rows per micro-batch")
    parser.add_argument("--microbatches", type=int, default=8)
    OUTPUTS.add_args(parser)
    args = parser.parse_args()
    path = OUTPUTS.path(args)
    config = {"steps": args.steps, "warmup": args.warmup, "hidden": args.hidden,
              "micro_batch": args.micro_batch, "microbatches": args.microbatches}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        spawn(_worker, 4, (config, str(out)), timeout_s=900)
        rows = json.loads(out.read_text())
    print(f"{'layout':8} {'schedule':12} {'measured':>10} {'simulated':>10} {'sim/meas':>8} "
          f"{'bubble meas':>11} {'bubble sim':>10}")
    for row in rows:
        print(f"{row['layout']:8} {row['schedule']:12} {row['measured_step_s'] * 1e3:8.1f} ms "
              f"{row['simulated_step_s'] * 1e3:8.1f} ms {row['simulated_over_measured']:8.2f} "
              f"{row['measured_bubble']:11.1%} {row['simulated_bubble']:10.1%}")
    import torch

    result = {"config": {**config, "ranks": 4, "layouts": {k: list(v) for k, v in LAYOUTS.items()}},
              "machine": {"cpus": __import__("os").cpu_count(), "python": platform.python_version(),
                          "torch": torch.__version__},
              "rows": rows}
    path.write_text(json.dumps(result, indent=2) + "\n")
    wrote(path)


if __name__ == "__main__":
    main()
