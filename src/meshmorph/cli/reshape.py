"""``meshmorph reshape``: print (and draw) the MovePlan from one Plan to another, running nothing:
bytes per device and link, messages, predicted time and lower bound, beside the naive rank-order
placement."""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path
from typing import Any

from meshmorph.cli.args import positive_float
from meshmorph.cli.output import finish, write_json
from meshmorph.cost.model import CostModel
from meshmorph.cost.profile import Profile
from meshmorph.elastic.moves.layout import layout_of
from meshmorph.elastic.moves.move_plan import DEFAULT_STAGING_BYTES, MovePlan, plan_move
from meshmorph.elastic.moves.move_time import MoveTimeModel, predict_move_time_s
from meshmorph.elastic.moves.placement import ReshapeError
from meshmorph.plan.report import does_not_fit_line, plan_headline
from meshmorph.spec.catalog import load_model
from meshmorph.spec.cluster import parse_cluster
from meshmorph.spec.plan import load_plan
from meshmorph.tables import Column, print_table, report_console
from meshmorph.viz.figure import pyplot, save_figure


def _ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated device ids such as 0,1,3, "
                                         f"got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("expected at least one device id")
    return ids


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def summary(move: MovePlan, seconds: float) -> dict[str, Any]:
    """The figures of one placement."""
    return {"placement": {str(r): d for r, d in move.placement.items()},
            "bytes_moved": move.bytes_moved, "network_bytes": move.network_bytes,
            "checkpoint_bytes": move.checkpoint_bytes,
            "busiest_device_bytes": move.busiest_device_bytes, "messages": move.messages,
            "predicted_time_s": seconds,
            "sent_bytes": {str(d): n for d, n in move.sent_bytes().items()},
            "received_bytes": {str(d): n for d, n in move.received_bytes().items()}}


def report(best: MovePlan, naive: MovePlan, best_s: float, naive_s: float) -> dict[str, Any]:
    """The JSON of ``meshmorph reshape``."""
    sent, received = best.sent_bytes(), best.received_bytes()
    messages = _messages(best)
    return {
        **summary(best, best_s),
        "lower_bound_bytes": best.lower_bound_bytes, "naive_bytes": best.naive_bytes,
        "staging_bytes": best.staging_bytes, "survivors": list(best.survivors),
        "devices": [{"device": d, "sent_bytes": sent[d], "received_bytes": received[d]}
                    for d in best.devices],
        "links": [{"src": s, "dst": d, "bytes": n, "messages": messages[s, d]}
                  for (s, d), n in best.link_bytes().items()],
        "from_checkpoint": [{"dst": t.dst_device, "key": t.key, "box": str(t.box),
                             "bytes": t.nbytes} for t in best.from_checkpoint],
        "fresh_keys": list(best.fresh_keys),
        "naive": summary(naive, naive_s),
    }


def _messages(move: MovePlan) -> Counter[tuple[int, int]]:
    """Messages per (source, destination) device pair."""
    return Counter((b.src_device, b.dst_device) for b in move.batches)


DEVICE_COLUMNS = (Column("device"), Column("new rank", "rank"), Column("sends"),
                  Column("receives"), Column("from checkpoint", "checkpoint"),
                  Column("rank order: new rank", "naive rank"), Column("sends", "naive sends"),
                  Column("receives", "naive recv"))
"""Columns of the bytes-per-device table: the best placement, then the rank-order one."""

PLACEMENT_COLUMNS = (Column("placement"), Column("new rank -> device", "rank->device", wrap=20),
                     Column("bytes moved", "moved"), Column("lower bound", "bound"),
                     Column("busiest device", "busiest"), Column("messages", "msgs"),
                     Column("predicted time", "time"))
"""Columns of the placements table (best and rank order)."""


def _print(best: MovePlan, naive: MovePlan, best_s: float, naive_s: float, headline: str,
           wide: bool = False) -> None:
    console = report_console(wide)
    console.print(headline)
    owner = {d: r for r, d in best.placement.items()}
    sent, received = best.sent_bytes(), best.received_bytes()
    naive_owner = {d: r for r, d in naive.placement.items()}
    naive_sent, naive_received = naive.sent_bytes(), naive.received_bytes()
    reads = {d: sum(t.nbytes for t in best.from_checkpoint if t.dst_device == d) for d in best.devices}
    devices = [[str(d), str(owner.get(d, "-")), _mib(sent[d]), _mib(received[d]),
                _mib(reads[d]), str(naive_owner.get(d, "-")), _mib(naive_sent[d]),
                _mib(naive_received[d])] for d in best.devices]
    print_table(console, DEVICE_COLUMNS, devices,
                title="bytes per device, best placement and rank order")
    messages = _messages(best)
    links = [[str(s), str(d), _mib(n), str(messages[s, d])]
             for (s, d), n in best.link_bytes().items()]
    print_table(console, (Column("source"), Column("destination"), Column("bytes"),
                          Column("messages")), links, title="bytes per link (best placement)")
    both = [[name, " ".join(f"{r}->{d}" for r, d in sorted(move.placement.items())),
             _mib(move.bytes_moved), _mib(best.lower_bound_bytes),
             _mib(move.busiest_device_bytes), str(move.messages), f"{seconds:.4f} s"]
            for name, move, seconds in (("best", best, best_s), ("rank order", naive, naive_s))]
    print_table(console, PLACEMENT_COLUMNS, both, title="placements")
    if best.from_checkpoint:
        console.print(f"{len(best.from_checkpoint)} pieces ({_mib(best.checkpoint_bytes)}) have "
                      "no live holder: read from the newest committed checkpoint")


def draw(best: MovePlan, naive: MovePlan, out_png: Path) -> Path:
    """Bytes per (source, destination) pair under both placements, side by side."""
    import numpy as np

    devices = sorted(set(best.devices) | set(naive.devices))
    index = {d: i for i, d in enumerate(devices)}
    fig, axes = pyplot().subplots(1, 2, figsize=(10, 4.5))
    top = max([1, *best.link_bytes().values(), *naive.link_bytes().values()]) / 2**20
    for ax, (name, move) in zip(axes, (("best placement", best), ("rank order", naive)),
                                strict=True):
        grid = np.zeros((len(devices), len(devices)))
        for (s, d), n in move.link_bytes().items():
            grid[index[s], index[d]] = n / 2**20
        image = ax.imshow(grid, cmap="viridis", vmin=0, vmax=top)
        ax.set_xticks(range(len(devices)), [str(d) for d in devices])
        ax.set_yticks(range(len(devices)), [str(d) for d in devices])
        ax.set(xlabel="destination device", ylabel="source device",
               title=f"{name}: {move.bytes_moved / 2**20:.1f} MiB moved")
        fig.colorbar(image, ax=ax, label="MiB")
    return save_figure(fig, out_png)


def _reshape(args: argparse.Namespace) -> int:
    plan_a, plan_b = load_plan(args.from_plan), load_plan(args.to_plan)
    if (plan_a.model, plan_a.seq_len) != (plan_b.model, plan_b.seq_len):
        raise ReshapeError(f"--from is a plan for {plan_a.model} at seq_len {plan_a.seq_len}, "
                           f"--to for {plan_b.model} at seq_len {plan_b.seq_len}; a reshape "
                           "keeps the model: give two plans for the same model")
    model = load_model(plan_a.model, plan_a.seq_len)
    plan_a, plan_b = (p if p.stages else p.with_even_stages(model) for p in (plan_a, plan_b))
    if args.cluster:  # refused before anything is planned or moved
        estimate = CostModel(model, parse_cluster(args.cluster)).estimate(plan_b)
        line = does_not_fit_line(plan_b, estimate)
        if line is not None:
            raise ReshapeError(f"the target plan does not fit memory, nothing would move: {line}")
    layout_a, layout_b = layout_of(model, plan_a), layout_of(model, plan_b)
    survivors = args.survivors if args.survivors is not None else list(range(plan_a.world_size))
    best = plan_move(layout_a, layout_b, survivors, args.new_devices,
                     staging_bytes=int(args.staging_mib * 2**20))
    naive = plan_move(layout_a, layout_b, survivors, args.new_devices,
                      staging_bytes=best.staging_bytes, placement=best.naive_placement)
    cluster = parse_cluster(args.cluster or f"cpu:1x{max(best.devices) + 1}")
    if max(best.devices) >= cluster.world_size:
        raise ReshapeError(f"the move uses device {max(best.devices)} but cluster "
                           f"{cluster.describe()} has {cluster.world_size} devices; give a "
                           "larger --cluster")
    # measured point-to-point alpha/beta instead of the catalog's links
    time_model = MoveTimeModel.from_profile(Profile.load(args.profile)) if args.profile else None
    best_s = predict_move_time_s(best, cluster, model=time_model)
    naive_s = predict_move_time_s(naive, cluster, model=time_model)
    headline = (f"reshape on {cluster.describe()}, survivors {','.join(map(str, best.survivors))}"
                f"\n  from: {plan_headline(plan_a, model)}\n  to:   {plan_headline(plan_b, model)}")
    _print(best, naive, best_s, naive_s, headline, args.wide)
    if args.json:
        write_json(args.json, report(best, naive, best_s, naive_s) | {
            "cluster": cluster.describe(), "from_plan": plan_a.to_dict(),
            "to_plan": plan_b.to_dict()})
        print(f"move plan written to {args.json}")
    if args.png:
        print(f"chart: {draw(best, naive, args.png)} (bytes per link, best vs rank order)")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "reshape", help="print the MovePlan from one plan to another (a dry run: nothing moves)",
        description="Plan the move of a job's training state (fp32 parameters, both AdamW "
                    "moments, step, LR schedule, RNG, data position) from plan A to plan B on "
                    "the devices still alive, with the fewest bytes; print bytes per device and "
                    "link, messages, the predicted time and the lower bound, beside the naive "
                    "rank-order placement.")
    parser.add_argument("--from", dest="from_plan", type=Path, required=True, metavar="A.json",
                        help="the plan the job runs now")
    parser.add_argument("--to", dest="to_plan", type=Path, required=True, metavar="B.json",
                        help="the plan to move to (same model and global batch)")
    parser.add_argument("--survivors", type=_ids, default=None, metavar="0,1,...",
                        help="old ranks still alive (default: all of plan A's ranks)")
    parser.add_argument("--new-devices", type=_ids, default=None, metavar="4,5,...",
                        help="ids of devices that join holding nothing (default: as many as "
                             "plan B lacks, numbered after plan A's ranks)")
    parser.add_argument("--cluster", default=None, metavar="SPEC",
                        help="cluster whose links price the move and whose memory the target "
                             "must fit (h100:1x8, a .toml file); default: local CPU processes, "
                             "no memory check")
    parser.add_argument("--staging-mib", type=positive_float, default=DEFAULT_STAGING_BYTES / 2**20,
                        help="largest batch a destination buffers, MiB (default 256)")
    parser.add_argument("--profile", type=Path, default=None, metavar="FILE",
                        help="price messages with a measured profile's send_recv/2 alpha/beta "
                             "(meshmorph profile --out FILE) instead of the catalog's links")
    finish(parser, _reshape, json="write the move's figures as JSON",
           png="draw bytes per link for both placements")
