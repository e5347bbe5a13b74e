"""``meshmorph run``: check a job file, its data and its plan, then train it under torchrun."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from meshmorph.cli.args import non_negative_int
from meshmorph.run.launch.launcher import launch, prepare_run
from meshmorph.run.metrics import LOSS_CHART, METRICS_FILE, read_metrics
from meshmorph.schedule.trace import TRACE_ENV

INTERRUPTED = 130
"""The launcher's exit code after Ctrl-C (128 + SIGINT), as a shell reports it."""


def draw_loss_chart(out_dir: Path) -> Path | None:
    """``loss.png`` of a run folder from its ``metrics.jsonl`` (None without step records)."""
    from meshmorph.viz.loss_chart import write_loss_chart

    metrics = out_dir / METRICS_FILE
    records = read_metrics(metrics) if metrics.is_file() else []
    return write_loss_chart(records, out_dir / LOSS_CHART) if records else None


def _run(args: argparse.Namespace) -> int:
    if args.trace:  # the ranks (started by torchrun) inherit it: run/engine/pipeline.py's RunTrace
        os.environ[TRACE_ENV] = str(args.trace)
    run = prepare_run(args.config, nproc=args.nproc, plan_arg=args.plan, resume=args.resume,
                      out=args.out, reshard=args.reshard, elastic=args.elastic,
                      inject_failure=args.inject_failure, node_rank=args.node_rank,
                      rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id)
    code = launch(run)
    # Ctrl-C asks to stop now: no chart (importing and drawing it took over 20 s on a loaded
    # machine); the resumed run draws the whole curve when it ends
    if code != INTERRUPTED and (run.node is None or run.node.rank == 0):
        chart = draw_loss_chart(run.out_dir)
        if chart is not None:
            print(f"loss chart in {chart}", flush=True)
    return code


def register(subparsers: argparse._SubParsersAction) -> None:
    run = subparsers.add_parser(
        "run", help="train a job on local processes (torchrun)",
        description="Check a job file, its data and its plan, then train it under torchrun.",
    )
    run.add_argument("--config", required=True, type=Path, help="job file (TOML)")
    run.add_argument("--nproc", type=int, default=None,
                     help="processes on this machine (default: the plan's world size, or 1)")
    run.add_argument("--plan", default=None, metavar="FILE|auto",
                     help="plan JSON, or 'auto' to search one; default: pure data parallelism")
    run.add_argument("--resume", action="store_true",
                     help="continue from the newest checkpoint of the run folder (refused if it "
                          "was saved by another model, data or plan)")
    run.add_argument("--reshard", action="store_true",
                     help="with --resume: load a checkpoint saved under another plan into this "
                          "one (DCP reshards on load)")
    run.add_argument("--out", type=Path, default=None,
                     help="run folder (default: [run] out_dir of the job file)")
    run.add_argument("--trace", type=non_negative_int, nargs="?", const=3, default=0, metavar="STEPS",
                     help="time every pipeline action of STEPS steps (default 3, after a warm-up "
                          "step) and write RUN_DIR/trace.json (Chrome/Perfetto); compare it with "
                          "'meshmorph timeline --compare RUN_DIR'")
    run.add_argument("--elastic", default=None, metavar="MIN:MAX",
                     help="run under torchrun's elastic agent (--nnodes MIN:MAX, c10d "
                          "rendezvous, restarts); state survives a worker restart in the "
                          "node-local store and is reshaped to the new world")
    run.add_argument("--inject-failure", default=None, metavar="RANK@STEP",
                     help="with --elastic: SIGKILL that rank's worker once, in that step")
    run.add_argument("--node-rank", type=int, default=None, metavar="K",
                     help="with --elastic: this machine is node K of several, --nproc workers "
                          "each (node 0 hosts the rendezvous at --rdzv-endpoint)")
    run.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                     help="with --node-rank: node 0's address and a free port there, the same on "
                          "every node")
    run.add_argument("--rdzv-id", default=None, metavar="ID",
                     help="with --node-rank: the job's id, the same on every node (default: "
                          "from the endpoint)")
    run.set_defaults(func=_run)
