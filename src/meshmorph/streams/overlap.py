"""Kernel overlap in a profiler trace: did kernels on different CUDA streams run at the same time?

``torch.profiler`` exports a Chrome trace whose GPU kernels are events with ``"cat": "kernel"``,
a start ``ts`` and duration ``dur`` in microseconds and ``args.stream``. Two kernels overlap when
they sit on different streams and their intervals intersect; the figure that matters is the busy
time covered by two or more streams at once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class KernelOverlap:
    """How much of a trace's kernel time ran on two or more streams at once."""

    kernels: int
    """Kernel events in the trace."""
    streams: int
    """Distinct CUDA streams that ran a kernel."""
    busy_us: float
    """Time with at least one kernel running, microseconds."""
    overlapped_us: float
    """Time with kernels of two or more streams running, microseconds."""


def kernel_intervals(trace: dict[str, Any]) -> list[tuple[float, float, int]]:
    """(start_us, end_us, stream) of every kernel event of a Chrome trace."""
    out = []
    for ev in trace.get("traceEvents", []):
        if ev.get("cat") == "kernel" and "ts" in ev and "dur" in ev:
            stream = int(ev.get("args", {}).get("stream", -1))
            out.append((float(ev["ts"]), float(ev["ts"]) + float(ev["dur"]), stream))
    return out


def kernel_overlap(trace: dict[str, Any]) -> KernelOverlap:
    """Sweep the kernel intervals; count time where >= 1 and >= 2 distinct streams are busy."""
    intervals = kernel_intervals(trace)
    points = sorted([(s, 1, st) for s, _, st in intervals] + [(e, -1, st) for _, e, st in intervals],
                    key=lambda p: (p[0], p[1]))  # at a tie, ends before starts
    active: dict[int, int] = {}
    busy = overlapped = 0.0
    last = None
    for t, delta, stream in points:
        if last is not None:
            running = sum(1 for c in active.values() if c > 0)
            busy += (t - last) if running >= 1 else 0.0
            overlapped += (t - last) if running >= 2 else 0.0
        active[stream] = active.get(stream, 0) + delta
        last = t
    return KernelOverlap(kernels=len(intervals), streams=len({st for *_, st in intervals}),
                         busy_us=busy, overlapped_us=overlapped)


def trace_overlap(path: Path) -> KernelOverlap:
    """``kernel_overlap`` of a Chrome trace file written by ``prof.export_chrome_trace``."""
    return kernel_overlap(json.loads(Path(path).read_text()))
