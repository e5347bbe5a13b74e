"""Pipeline timelines as Chrome/Perfetto traces: ``{"traceEvents": [...]}``, one complete event
(``"ph": "X"``) per action, ``pid`` and ``tid`` the pipeline rank, times in microseconds.

The same format holds a simulated step (``timeline_events``) and a measured one (``meshmorph run
--trace`` writes it from the runtime), so ``meshmorph timeline --compare`` can lay one over the
other. Open a trace in https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from meshmorph.files import read_document

TRACE_ENV = "MESHMORPH_TRACE_STEPS"
"""Set by ``meshmorph run --trace N``: the ranks time every pipeline action of N steps and write
them in this format."""
OpRecord = tuple[int, str, int, int, float, float]
"""(rank, kind, stage, micro-batch, start_s, end_s): one action of a timeline."""


class TraceError(ValueError):
    """A trace file that is not a pipeline trace; the message says what is missing."""


def timeline_events(ops: Iterable[OpRecord], *, pid_offset: int = 0, label: str = "rank"
                    ) -> list[dict[str, Any]]:
    """One complete event per action (times in µs), and a name for every rank's row."""
    events: list[dict[str, Any]] = []
    ranks: set[int] = set()
    for rank, kind, stage, mb, start, end in ops:
        ranks.add(rank)
        events.append({"name": f"{kind}{mb}", "cat": kind, "ph": "X", "ts": start * 1e6,
                       "dur": (end - start) * 1e6, "pid": pid_offset + rank,
                       "tid": pid_offset + rank,
                       "args": {"kind": kind, "stage": stage, "microbatch": mb, "rank": rank}})
    for rank in sorted(ranks):
        events.append({"name": "process_name", "ph": "M", "pid": pid_offset + rank,
                       "tid": pid_offset + rank, "args": {"name": f"{label} {rank}"}})
    return events


def write_trace(path: Path, events: Sequence[dict[str, Any]], **metadata: Any) -> Path:
    """Write ``{"traceEvents": events, ...metadata}`` to ``path`` (creating its folder)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": list(events), "displayTimeUnit": "ms",
                                **metadata}) + "\n")
    return path


def read_trace_ops(path: Path) -> list[OpRecord]:
    """The actions of a pipeline trace as timeline records (seconds, from the first start)."""
    data = read_document(path, what="trace", fmt="json", error=TraceError, way_out=(
        "write one with 'meshmorph run --trace' or 'meshmorph timeline --trace'"))
    events = data.get("traceEvents")
    if not isinstance(events, list):
        raise TraceError(f"{path} holds no 'traceEvents' list; it is not a Chrome trace")
    try:
        ops = [(int(e["args"]["rank"]), str(e["args"]["kind"]), int(e["args"]["stage"]),
                int(e["args"]["microbatch"]), e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6)
               for e in events if e.get("ph") == "X" and "rank" in e.get("args", {})]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise TraceError(f"{path} holds a pipeline action without a whole rank, kind, stage, "
                         f"microbatch, ts and dur ({type(exc).__name__}: {exc}); write it with "
                         "'meshmorph run --trace'") from None
    if not ops:
        raise TraceError(f"{path} holds no pipeline actions (complete events with a rank)")
    t0 = min(op[4] for op in ops)
    return sorted(((r, k, s, j, a - t0, b - t0) for r, k, s, j, a, b in ops),
                  key=lambda op: (op[4], op[0]))
