"""``meshmorph timeline``: draw a pipeline schedule per rank (PNG) and write it as a trace.

- ``--plan P.json [--cluster C]``: the plan's schedule on the cost model's per-stage times;
- ``--schedule NAME --pp P --microbatches M [--vpp V]``: a quick look on uniform stages (a rank's
  layers take F 1 ms, B 2 ms = I 1 ms + W 1 ms, split evenly over its chunks);
- ``--compare RUN_DIR``: the measured trace of ``meshmorph run --trace`` (``RUN_DIR/trace.json``)
  over the same schedule simulated with the run's own median action times.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from meshmorph.cli.args import positive_int
from meshmorph.cli.output import finish
from meshmorph.cost.model import CostModel
from meshmorph.schedule.registry import SCHEDULE_NAMES, check_size, chunks_per_rank
from meshmorph.schedule.simulator import StageTimes, Timeline, simulate_schedule
from meshmorph.schedule.table import Schedule
from meshmorph.schedule.trace import OpRecord, read_trace_ops, timeline_events, write_trace
from meshmorph.spec.catalog import load_model
from meshmorph.spec.cluster import parse_cluster
from meshmorph.spec.plan import load_plan

TRACE_FILE = "trace.json"
"""Name of the measured trace inside a run folder."""


MAX_DRAWN_PAIRS = 1 << 16
"""The most (stage, micro-batch) pairs ``timeline`` draws: a chart of more cannot be read."""

def uniform_times(name: str, p: int, v: int) -> StageTimes:
    """A rank's layers take F 1 ms and B 2 ms (I 1 ms + W 1 ms), split evenly over its chunks."""
    chunks = chunks_per_rank(name, v)
    n, k = p * chunks, 1e-3 / chunks
    return StageTimes([k] * n, [2 * k] * n, igrad_s=[k] * n, wgrad_s=[k] * n)


def describe(timeline: Timeline) -> str:
    """The summary line: step time, bubble and peak activations per rank."""
    peaks = " ".join(str(x) for x in timeline.peak_activations)
    step = (f"{timeline.makespan_s * 1e3:.3f} ms" if timeline.makespan_s < 10
            else f"{timeline.makespan_s:.3f} s")
    return (f"step {step}  bubble {timeline.bubble_fraction:.1%}  "
            f"peak activations per rank {peaks}")


def measured_times(ops: list[OpRecord], stages: int) -> StageTimes:
    """Per-stage median durations of each action kind in a measured trace."""
    spans: dict[tuple[str, int], list[float]] = defaultdict(list)
    for _, kind, stage, _, start, end in ops:
        spans[kind, stage].append(end - start)

    def median(kind: str) -> list[float]:
        return [statistics.median(spans[kind, s]) if spans[kind, s] else 0.0
                for s in range(stages)]

    fwd, bwd, igrad, wgrad = median("F"), median("B"), median("I"), median("W")
    full = [b if b else i + w for b, i, w in zip(bwd, igrad, wgrad, strict=True)]
    return StageTimes(fwd, full, igrad_s=[i if i else b for i, b in zip(igrad, full, strict=True)],
                      wgrad_s=wgrad)


def _compare(run_dir: Path) -> tuple[list[tuple[str, list[OpRecord]]], str]:
    meta_path = run_dir / TRACE_FILE
    measured = read_trace_ops(meta_path)  # a missing, unreadable or malformed trace stops here
    meta = json.loads(meta_path.read_text())
    schedule = meta.get("schedule")
    if schedule not in SCHEDULE_NAMES:
        raise ValueError(f"{meta_path} does not name its schedule; write it with "
                         f"'meshmorph run --trace'")
    counts = {key: meta.get(key, default) for key, default in
              (("pp", None), ("microbatches", None), ("vpp", 1), ("steps", 1))}
    for key, value in counts.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{meta_path}: {key} must be a whole number >= 1, got {value!r}; "
                             "write it with 'meshmorph run --trace'")
    p, m, v = counts["pp"], counts["microbatches"], counts["vpp"]
    chunks = chunks_per_rank(schedule, v)
    check_size(p, m, chunks, MAX_DRAWN_PAIRS, "a readable chart")
    times = measured_times([op for op in measured if op[1] != "STEP"], p * chunks)
    predicted = simulate_schedule(schedule, p, m, times, v=v)
    measured_end = max(op[5] for op in measured)
    lanes = [(f"simulated from the run's median action times: {schedule} pp {p} m {m}",
              list(predicted.ops)),
             (f"measured ({meta.get('steps', 1)} step(s))", measured)]
    summary = (f"simulated {predicted.makespan_s * 1e3:.3f} ms per step, measured "
               f"{measured_end * 1e3 / max(1, int(meta.get('steps', 1))):.3f} ms per step")
    return lanes, summary


def _timeline(args: argparse.Namespace) -> int:
    from meshmorph.viz.timeline_chart import Lane, draw_timelines

    if args.compare is not None:
        lanes, summary = _compare(args.compare)
        print(summary)
        events = timeline_events(lanes[0][1], label="simulated rank") + \
            timeline_events(lanes[1][1], pid_offset=1000, label="measured rank")
    else:
        title, timeline = _simulated(args)
        print(title)
        print(describe(timeline))
        lanes = [(title, list(timeline.ops))]
        events = timeline_events(timeline.ops)
    if args.png:
        draw_timelines([Lane(t, ops) for t, ops in lanes], args.png)
        print(f"png: {args.png}")
    if args.trace:
        write_trace(args.trace, events)
        print(f"trace: {args.trace} ({sum(e['ph'] == 'X' for e in events)} events; open it in "
              f"https://ui.perfetto.dev)")
    return 0


def _simulated(args: argparse.Namespace) -> tuple[str, Timeline]:
    if args.plan is not None:
        from meshmorph.viz.timeline_chart import plan_timeline, plan_title

        plan = load_plan(args.plan)
        cluster_text = args.cluster or _cluster_of(args.plan)
        cost = CostModel(load_model(plan.model, plan.seq_len), parse_cluster(cluster_text))
        return (f"{plan.model} on {cluster_text}: {plan_title(plan, args.schedule)}",
                plan_timeline(plan, cost, args.schedule))
    if args.schedule is None or args.pp is None or args.microbatches is None:
        raise ValueError("timeline needs --plan FILE, or --schedule NAME --pp P --microbatches M "
                         "(or --compare RUN_DIR)")
    if Schedule(args.schedule) == Schedule.INTERLEAVED and args.vpp < 2:
        raise ValueError("--schedule interleaved places --vpp chunks on each rank: give --vpp 2 "
                         "or more (with one chunk per rank it is 1f1b)")
    v = chunks_per_rank(args.schedule, 1 if Schedule(args.schedule).v_shape else args.vpp)
    check_size(args.pp, args.microbatches, v, MAX_DRAWN_PAIRS, "a readable chart")
    timeline = simulate_schedule(args.schedule, args.pp, args.microbatches,
                                 uniform_times(args.schedule, args.pp, v), v=v)
    return (f"{args.schedule} pp {args.pp} m {args.microbatches}"
            f"{f' v{v}' if v > 1 else ''} (uniform stages: a rank's F 1 ms, B 2 ms = I 1 + W 1)",
            timeline)


def _cluster_of(plan_path: Path) -> str:
    data = json.loads(plan_path.read_text())
    cluster = data.get("cluster") if isinstance(data, dict) else None
    if not isinstance(cluster, str):
        raise ValueError(f"{plan_path} does not name its cluster; pass --cluster "
                         f"(e.g. h100:4x8 or a .toml)")
    return cluster


def register(subparsers: argparse._SubParsersAction) -> None:
    tl = subparsers.add_parser(
        "timeline", help="draw a pipeline schedule per rank (PNG) and write it as a trace",
        description="Simulate a pipeline schedule (a plan's, or a named one on uniform stages) "
                    "and draw it per rank with its bubbles, or compare a run's measured trace "
                    "with the simulation. Prints step time, bubble and peak activations.")
    tl.add_argument("--plan", type=Path, default=None, help="plan JSON (meshmorph plan --json)")
    tl.add_argument("--cluster", default=None,
                    help="cluster for the plan's per-stage times (default: the file's)")
    tl.add_argument("--schedule", choices=SCHEDULE_NAMES, default=None,
                    help="schedule to draw (with --plan: the plan's stages under it)")
    tl.add_argument("--pp", type=positive_int, default=None, help="pipeline ranks (quick look)")
    tl.add_argument("--microbatches", type=positive_int, default=None,
                    help="micro-batches per step (quick look)")
    tl.add_argument("--vpp", type=positive_int, default=1, help="chunks per rank (interleaved)")
    tl.add_argument("--compare", type=Path, default=None, metavar="RUN_DIR",
                    help="overlay the measured trace of 'meshmorph run --trace' and the simulation")
    finish(tl, _timeline, wide=False, png="write the Gantt chart here",
           trace="write a Chrome/Perfetto trace here ({\"traceEvents\": [...]})")
