"""Forward latency of the streams catalog nets: eager against meshmorph's stream assignment.

On CUDA, for each net at each batch: eager PyTorch, ``torch.compile(mode="reduce-overhead")``,
a single-stream CUDA graph of the module, and meshmorph's multi-stream CUDA graph (width streams,
events for the syncs). Median of ``--repeats`` timed forwards after ``--warmup`` untimed ones, the
device synchronised around each; each output is compared with eager's. A profiler trace of one
multi-stream replay per net gives the time kernels of two or more streams ran at once.

On CPU there are no streams to overlap: the script times eager against the CPU stream executor
(the same operators, interleaved by stream, checked to equal eager exactly) and records that the
GPU figures need CUDA; it measures none of them.

    python bench/streams.py                      # all three nets, batch 1 and 32
    python bench/streams.py --nets resnet-stack --batches 1 --repeats 5 --out /tmp/s.json

Writes bench/results/latest/streams.json (``--out PATH`` to choose, ``--update`` for the committed
bench/results/streams.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from meshmorph.demos.nets import NETS, build_net, example_input
from meshmorph.streams.assign import assign_streams
from meshmorph.streams.executor import StreamExecutor
from meshmorph.streams.op_graph import build_op_graph
from results_path import Outputs, wrote

OUTPUTS = Outputs("bench/results/streams.json")


def median_s(fns: dict[str, Callable[[], Any]], warmup: int, repeats: int,
             cuda: bool) -> dict[str, float]:
    """Median seconds of each function, timed in turn within every repeat (a busy machine's slow
    spells then hit all of them alike)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {label: [] for label in fns}
    for _ in range(repeats):
        for label, fn in fns.items():
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            samples[label].append(time.perf_counter() - start)
    return {label: statistics.median(values) for label, values in samples.items()}


def cpu_case(name: str, batch: int, warmup: int, repeats: int) -> dict[str, Any]:
    model = build_net(name).eval()
    x = example_input(model, batch)
    graph = build_op_graph(model, (x,))
    assignment = assign_streams(graph.dag, graph.order)
    executor = StreamExecutor(graph, assignment)
    with torch.no_grad():
        equal = torch.equal(executor(x), model(x))
        times = median_s({"eager_s": lambda: model(x), "stream_executor_s": lambda: executor(x)},
                         warmup, repeats, cuda=False)
    return {"net": name, "batch": batch, "ops": len(assignment.order), "width": assignment.width,
            "streams": len(assignment.streams), "syncs": len(assignment.syncs), **times,
            "executor_equals_eager": equal}


def cuda_case(name: str, batch: int, warmup: int, repeats: int, trace_dir: Path) -> dict[str, Any]:
    from meshmorph.streams.cuda_graph import ModuleGraph, StreamGraph
    from meshmorph.streams.overlap import trace_overlap

    model = build_net(name).cuda().eval()
    x = example_input(model, batch).cuda()
    graph = build_op_graph(model, (x,), timing="profile")
    assignment = assign_streams(graph.dag, graph.order)
    record: dict[str, Any] = {"net": name, "batch": batch, "ops": len(assignment.order),
                              "width": assignment.width, "streams": len(assignment.streams),
                              "syncs": len(assignment.syncs)}
    with torch.no_grad():
        reference = model(x).clone()
        compiled = torch.compile(model, mode="reduce-overhead")
        single = ModuleGraph(model, (x,))
        multi = StreamGraph(graph, assignment, (x,))
        runs = {"eager": lambda: model(x), "compile_reduce_overhead": lambda: compiled(x),
                "cuda_graph_single_stream": lambda: single.replay(x),
                "cuda_graph_multi_stream": lambda: multi.replay(x)}
        for label, fn in runs.items():
            out = fn()
            record[f"{label}_max_abs_diff"] = float((out - reference).abs().max())
        times = median_s({f"{label}_s": fn for label, fn in runs.items()}, warmup, repeats,
                         cuda=True)
        record.update(times)
        record["speedup_vs_reduce_overhead"] = (record["compile_reduce_overhead_s"]
                                                / record["cuda_graph_multi_stream_s"])
        trace = trace_dir / f"streams-{name}-b{batch}.json"
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            multi.replay(x)
            torch.cuda.synchronize()
        prof.export_chrome_trace(str(trace))
    overlap = trace_overlap(trace)
    record.update(trace=str(trace), trace_kernels=overlap.kernels,
                  trace_kernel_streams=overlap.streams, trace_busy_us=overlap.busy_us,
                  trace_overlapped_us=overlap.overlapped_us)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nets", nargs="+", default=list(NETS), choices=list(NETS))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--trace-dir", type=Path, default=None,
                        help="where profiler traces go on CUDA (default: a temporary folder)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: the nets' tiny ops only wait on more)")
    OUTPUTS.add_args(parser)
    args = parser.parse_args()
    out = OUTPUTS.path(args)
    torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available()
    trace_dir = args.trace_dir or Path(tempfile.mkdtemp(prefix="streams-trace-"))
    trace_dir.mkdir(parents=True, exist_ok=True)
    cases = []
    for name in args.nets:
        for batch in args.batches:
            case = (cuda_case(name, batch, args.warmup, args.repeats, trace_dir) if cuda
                    else cpu_case(name, batch, args.warmup, args.repeats))
            cases.append(case)
            times = {k: f"{v * 1e3:.3f} ms" for k, v in case.items() if k.endswith("_s")}
            print(f"{name} batch {batch}: width {case['width']}, {case['streams']} streams, "
                  f"{case['syncs']} syncs; " + ", ".join(f"{k} {v}" for k, v in times.items()))
    result = {
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "device_type": "cuda" if cuda else "cpu", "torch": torch.__version__,
        "python": platform.python_version(), "torch_threads": torch.get_num_threads(),
        "warmup": args.warmup, "repeats": args.repeats, "cases": cases,
        "gpu_figures": None if not cuda else "measured",
        "note": ("CPU only: eager against the CPU stream executor; eager, reduce-overhead, "
                 "single- and multi-stream CUDA graph latencies need a CUDA device and were "
                 "not measured") if not cuda else "medians over repeats, device synchronised",
    }
    out.write_text(json.dumps(result, indent=2) + "\n")
    if not cuda:
        print("no CUDA device: GPU figures (reduce-overhead, CUDA graphs, overlap) need CUDA; "
              "none were measured")
    wrote(out)


if __name__ == "__main__":
    main()
