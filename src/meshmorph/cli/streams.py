"""``meshmorph streams``: the operator graph of a net, its width, streams, syncs and a picture; the
assignment is run once with the CPU stream executor to check that the output equals eager mode
bit for bit and that the race checks find nothing."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from meshmorph.cli.output import finish, write_json
from meshmorph.tables import Column, print_table, report_console

if TYPE_CHECKING:  # the console script starts without torch
    from meshmorph.streams.assign import StreamAssignment

STREAM_COLUMNS = (Column("stream"), Column("ops"), Column("est. time (us)", "est. us"),
                  Column("first op", justify="left", wrap=24),
                  Column("last op", justify="left", wrap=24))
"""Columns of the streams table of ``meshmorph streams``."""

SYNC_COLUMNS = (Column("after op", justify="left", wrap=30), Column("stream", justify="left"),
                Column("before op", justify="left", wrap=30), Column("stream ", justify="left"))
"""Columns of the syncs table of ``meshmorph streams``."""

CATALOG_NETS = ("inception-stack", "nasnet-stack", "resnet-stack")
"""Names in streams.nets.NETS, listed here so that the console script starts without torch."""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "streams", help="assign a net's operators to parallel streams (Nimble, width streams)",
        description="Trace a net into its operator DAG, assign its operators to width-many "
                    "streams with the fewest syncs, check the assignment on CPU and print it.",
    )
    parser.add_argument("--model", default="inception-stack", metavar="NAME|module:fn",
                        help=f"catalog net ({', '.join(CATALOG_NETS)}) or a factory returning an "
                             "nn.Module (default inception-stack)")
    parser.add_argument("--batch", type=int, default=1, help="batch size of the example input")
    parser.add_argument("--input-shape", default=None, metavar="C,H,W",
                        help="one sample's shape, for a factory whose module has no "
                             "example_input_shape")
    parser.add_argument("--max-streams", type=int, default=None, metavar="K",
                        help="at most K streams: merge the shortest streams by estimated time")
    parser.add_argument("--method", choices=("width", "nimble"), default="width",
                        help="width: exactly width streams, fewest syncs among them (default); "
                             "nimble: Nimble's matching on the transitive reduction")
    parser.add_argument("--timing", choices=("estimate", "profile"), default="estimate",
                        help="operator times from FLOPs and bytes (default) or measured here")
    parser.add_argument("--training", action="store_true",
                        help="the aten-level training step (forward and backward) instead of "
                             "the forward")
    finish(parser, _streams, json="write the result", png="draw the streams")


def _shape(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--input-shape {text!r} must be comma-separated integers, e.g. 3,32,32") from None
    if not shape or min(shape) <= 0:
        raise ValueError(f"--input-shape {text!r} needs positive sizes, e.g. 3,32,32")
    return shape


def streams_report(args: argparse.Namespace) -> tuple[dict[str, Any], StreamAssignment]:
    """Trace, assign and check: the JSON document the subcommand prints and writes, and the
    assignment."""
    import torch

    from meshmorph.demos.nets import build_net, example_input
    from meshmorph.streams.assign import assign_streams
    from meshmorph.streams.cap import makespan_s
    from meshmorph.streams.executor import StreamExecutor
    from meshmorph.streams.op_graph import build_op_graph
    from meshmorph.streams.race import schedule_races, trace_races

    if args.max_streams is not None and args.max_streams < 1:
        raise ValueError(f"--max-streams must be at least 1, got {args.max_streams}")
    model = build_net(args.model).train(args.training)
    x = example_input(model, args.batch, _shape(args.input_shape))
    graph = build_op_graph(model, (x,), timing=args.timing, training=args.training)
    assignment = assign_streams(graph.dag, graph.order, method=args.method,
                                max_streams=args.max_streams)
    executor = StreamExecutor(graph, assignment)
    with torch.no_grad():  # a training graph computes its gradients itself
        ours = executor(x)
        eager = graph.module(*graph.leading_inputs, x) if args.training else model(x)
    pairs = zip(ours, eager, strict=True) if args.training else [(ours, eager)]
    equal = all(torch.equal(a, b) for a, b in pairs)
    races = schedule_races(graph.dag, assignment) + trace_races(graph.dag, assignment,
                                                                executor.last_trace)
    order, streams = list(assignment.order), [list(s) for s in assignment.streams]
    return {
        "model": args.model, "batch": args.batch, "method": assignment.method,
        "graph": "training step (aten, forward and backward)" if args.training else "forward (fx)",
        "nodes": order, "edges": [list(e) for e in assignment.reduced_edges],
        "assignment": assignment.stream_of, "streams": streams,
        "members": {op: list(m) for op, m in graph.members.items() if len(m) > 1},
        "syncs": [list(e) for e in assignment.syncs], "width": assignment.width,
        "num_streams": len(streams), "dag_edges": graph.dag.number_of_edges(),
        "time_s": {op: graph.dag.nodes[op]["time_s"] for op in order},
        "serial_time_s": makespan_s(graph.dag, order, [order]),
        "makespan_s": makespan_s(graph.dag, order, streams),
        "executor_equals_eager": equal, "races": len(races),
    }, assignment


def _print(report: dict[str, Any], wide: bool = False) -> None:
    console = report_console(wide)
    console.print(f"[bold]{report['model']}[/] batch {report['batch']}, {report['graph']}: "
                  f"{len(report['nodes'])} ops, "
                  f"{report['dag_edges']} edges ({len(report['edges'])} in the transitive "
                  f"reduction)", soft_wrap=True)
    console.print(f"width {report['width']}; {report['num_streams']} streams ({report['method']}); "
                  f"{len(report['syncs'])} syncs", soft_wrap=True)
    times = report["time_s"]
    print_table(console, STREAM_COLUMNS,
                [[str(s), str(len(ops)), f"{sum(times[o] for o in ops) * 1e6:.1f}", ops[0], ops[-1]]
                 for s, ops in enumerate(report["streams"])], title="streams")
    print_table(console, SYNC_COLUMNS,
                [[u, str(report["assignment"][u]), v, str(report["assignment"][v])]
                 for u, v in report["syncs"]],
                title="syncs (event recorded after, waited on before)")
    console.print(f"estimated time: {report['serial_time_s'] * 1e6:.1f} us on one stream, "
                  f"{report['makespan_s'] * 1e6:.1f} us on {report['num_streams']} streams", soft_wrap=True)
    what = "the graph run in program order" if report["graph"].startswith("training") else "eager"
    console.print(f"CPU stream executor: output equals {what} {report['executor_equals_eager']}; "
                  f"races found {report['races']}", soft_wrap=True)


def _streams(args: argparse.Namespace) -> int:
    report, assignment = streams_report(args)
    _print(report, args.wide)
    if args.json is not None:
        write_json(args.json, report)
        print(f"wrote {args.json}")
    if args.png is not None:
        from meshmorph.viz.streams_chart import write_streams_chart

        write_streams_chart(assignment, args.png, title=f"{report['model']} batch {report['batch']}: "
                            f"width {report['width']}, {report['num_streams']} streams, "
                            f"{len(report['syncs'])} syncs (red)")
        print(f"wrote {args.png}")
    return 0 if report["executor_equals_eager"] and report["races"] == 0 else 1
