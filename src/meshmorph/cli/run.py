"""``meshmorph run``: check a job file, its data and its plan, then train it under torchrun."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def _run(args: argparse.Namespace) -> int:
    from meshmorph.run.launch.launcher import run_job

    if args.trace:  # the ranks (started by torchrun) inherit it: run/engine/pipeline.py's RunTrace
        from meshmorph.run.engine.pipeline import TRACE_ENV

        os.environ[TRACE_ENV] = str(args.trace)
    return run_job(args.config, nproc=args.nproc, plan_arg=args.plan, resume=args.resume,
                   out=args.out, reshard=args.reshard, elastic=args.elastic,
                   inject_failure=args.inject_failure, node_rank=args.node_rank,
                   rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id)


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
    run.add_argument("--trace", type=int, nargs="?", const=3, default=0, metavar="STEPS",
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
