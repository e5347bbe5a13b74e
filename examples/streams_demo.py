"""Streams in a minute: trace a multi-branch net, assign its operators to streams, run them.

    python examples/streams_demo.py                       # inception-stack, batch 1
    python examples/streams_demo.py nasnet-stack 2 /tmp/nasnet-streams.png

Prints the operator count, the width, the streams Nimble's published matching would use beside
meshmorph's width streams (the same syncs), checks the CPU stream executor against eager mode and
the race checks, and draws the assignment. With a CUDA device it also captures the multi-stream
forward into a CUDA graph and compares one replay with eager.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from meshmorph.demos.nets import build_net, example_input
from meshmorph.streams.assign import assign_streams
from meshmorph.streams.executor import StreamExecutor
from meshmorph.streams.op_graph import build_op_graph
from meshmorph.streams.race import schedule_races, trace_races
from meshmorph.viz.streams_chart import write_streams_chart


def main(name: str = "inception-stack", batch: int = 1,
         png: Path = Path("streams-demo.png")) -> None:
    torch.set_num_threads(1)
    model = build_net(name).eval()
    x = example_input(model, batch)
    graph = build_op_graph(model, (x,))
    ours = assign_streams(graph.dag, graph.order)
    nimble = assign_streams(graph.dag, graph.order, method="nimble")
    print(f"{name}: {len(ours.order)} operators, width {ours.width}")
    print(f"  Nimble's matching on the reduction: {len(nimble.streams)} streams, "
          f"{len(nimble.syncs)} syncs")
    print(f"  meshmorph (closure, lexicographic): {len(ours.streams)} streams, "
          f"{len(ours.syncs)} syncs")
    executor = StreamExecutor(graph, ours)
    with torch.no_grad():
        equal = torch.equal(executor(x), model(x))
    races = schedule_races(graph.dag, ours) + trace_races(graph.dag, ours, executor.last_trace)
    print(f"  CPU stream executor equals eager: {equal}; races: {len(races)}")
    print(f"  chart: {write_streams_chart(ours, png)}")
    if torch.cuda.is_available():
        from meshmorph.streams.cuda_graph import StreamGraph

        model, x = model.cuda(), x.cuda()
        graph = build_op_graph(model, (x,))
        captured = StreamGraph(graph, assign_streams(graph.dag, graph.order), (x,))
        with torch.no_grad():
            diff = (captured.replay(x) - model(x)).abs().max().item()
        print(f"  CUDA graph on {len(ours.streams)} streams: max |replay - eager| = {diff:.2e}")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0] if args else "inception-stack", int(args[1]) if len(args) > 1 else 1,
         Path(args[2]) if len(args) > 2 else Path("streams-demo.png"))
