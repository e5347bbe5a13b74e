"""A picture of a stream assignment: one column per stream, operators top to bottom in issue order.

Nodes are coloured by stream; edges of the transitive reduction inside a stream are thin grey
lines, synchronised cross-stream edges red dashed arrows, cross-stream edges that another sync
already implies (after a cap) dotted grey.
"""

from __future__ import annotations

from pathlib import Path

from meshmorph.streams.assign import StreamAssignment
from meshmorph.viz.figure import pyplot, save_figure

MAX_INCHES = (24.0, 40.0)
"""Largest figure (width, height) in inches; one stream column and one op row scale down past it."""
MAX_LABELLED_OPS = 150
"""Operators beyond which names are left off (they would overlap)."""


def write_streams_chart(assignment: StreamAssignment, out_png: Path, *, title: str = "",
                        labels: bool = True) -> Path:
    """Draw ``assignment`` to ``out_png`` (PNG) and return the path."""
    plt = pyplot()
    stream_of = assignment.stream_of
    count = len(assignment.streams)
    xy = {op: (float(stream_of[op]), -float(i)) for i, op in enumerate(assignment.order)}
    colours = plt.get_cmap("tab10" if count <= 10 else "tab20")
    # big graphs (a training step): bounded canvas, no per-operator labels
    fig, ax = plt.subplots(figsize=(min(2.0 + 1.6 * count, MAX_INCHES[0]),
                                    min(1.5 + 0.16 * len(assignment.order), MAX_INCHES[1])))
    labels = labels and len(assignment.order) <= MAX_LABELLED_OPS
    syncs = set(assignment.syncs)
    for u, v in assignment.reduced_edges:
        (x0, y0), (x1, y1) = xy[u], xy[v]
        if (u, v) in syncs:
            ax.annotate("", xy=(x1, y1), xytext=(x0, y0),
                        arrowprops={"arrowstyle": "->", "color": "#d62728", "linestyle": "--",
                                    "linewidth": 1.0, "shrinkA": 4, "shrinkB": 4})
        else:
            style = "-" if stream_of[u] == stream_of[v] else ":"
            ax.plot([x0, x1], [y0, y1], style, color="#999999", linewidth=0.8, zorder=1)
    for s, ops in enumerate(assignment.streams):
        ax.scatter([xy[op][0] for op in ops], [xy[op][1] for op in ops], s=36, zorder=2,
                   color=colours(s % colours.N), label=f"stream {s} ({len(ops)} ops)")
        if labels:
            for op in ops:
                ax.text(xy[op][0] + 0.08, xy[op][1], op, fontsize=6, va="center")
    ax.set_xticks(range(count), [f"stream {s}" if count <= 12 else str(s) for s in range(count)])
    ax.set(xlim=(-0.5, count - 0.1), yticks=[], ylabel="issue order (top first)")
    ax.set_title(title or f"{len(assignment.order)} ops, width {assignment.width}, {count} streams, "
                          f"{len(assignment.syncs)} syncs (red)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return save_figure(fig, out_png)
