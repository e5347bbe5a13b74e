"""Cutting a needed box into cells that each lie wholly inside or wholly outside every source
box, so that each cell has a definite set of devices able to send it; neighbouring cells with
the same senders are merged back into larger boxes (fewer, larger transfers)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from meshmorph.elastic.moves.box import Box


def _cuts(needed: Box, boxes: Sequence[Box], dim: int) -> list[int]:
    """Sorted cut points along ``dim``: the needed box's ends and every source box's ends inside it."""
    lo, hi = needed.offset[dim], needed.stop[dim]
    points = {lo, hi}
    for box in boxes:
        points.update(p for p in (box.offset[dim], box.stop[dim]) if lo < p < hi)
    return sorted(points)


def merge_cells(cells: list[tuple[Box, frozenset[int]]]) -> list[tuple[Box, frozenset[int]]]:
    """Merge boxes that touch along one dim, agree on the others and share their senders,
    dim by dim from the last (a grid of cells becomes its largest row-major blocks)."""
    ndim = cells[0][0].ndim if cells else 0
    for dim in reversed(range(ndim)):
        def along(cell: tuple[Box, frozenset[int]], dim: int = dim) -> tuple:
            box, who = cell
            rest = tuple(v for i, v in enumerate(zip(box.offset, box.length, strict=True)) if i != dim)
            return (sorted(who), rest, box.offset[dim])
        merged: list[tuple[Box, frozenset[int]]] = []
        for cell in sorted(cells, key=along):
            if merged:
                prev, who = merged[-1]
                box = cell[0]
                same_rest = all(prev.offset[i] == box.offset[i] and prev.length[i] == box.length[i]
                                for i in range(ndim) if i != dim)
                if who == cell[1] and same_rest and prev.stop[dim] == box.offset[dim]:
                    length = list(prev.length)
                    length[dim] += box.length[dim]
                    merged[-1] = (Box(prev.offset, tuple(length)), who)
                    continue
            merged.append(cell)
        cells = merged
    return cells


def cover(needed: Box, sources: Sequence[tuple[int, Box]]) -> list[tuple[Box, frozenset[int]]]:
    """``needed`` as disjoint boxes, each with the devices (from ``sources``: (device, box held))
    that hold all of it; an empty set means no live device holds it.

    The cut points of every dim make a grid; per dim and grid interval a bitmask says which
    sources span that interval, and a cell's senders are the AND of its intervals' masks."""
    if needed.numel == 0:
        return []
    inside = [(device, common) for device, box in sources
              if (common := needed.intersect(box)) is not None]
    if needed.ndim == 0:
        return [(needed, frozenset(device for device, _ in inside))]
    boxes = [box for _, box in inside]
    axes = []  # per dim: [(start, stop, mask of the sources spanning it)]
    for dim in range(needed.ndim):
        cuts = _cuts(needed, boxes, dim)
        axes.append([(lo, hi, sum(1 << i for i, box in enumerate(boxes)
                                  if box.offset[dim] <= lo and hi <= box.offset[dim] + box.length[dim]))
                     for lo, hi in zip(cuts[:-1], cuts[1:], strict=True)])
    names: dict[int, frozenset[int]] = {}
    cells = []
    for corner in itertools.product(*axes):
        mask = -1
        for _, _, bits in corner:
            mask &= bits
        if mask not in names:
            names[mask] = frozenset(inside[i][0] for i in range(len(inside)) if mask >> i & 1)
        cells.append((Box._trusted(tuple(lo for lo, _, _ in corner),
                                   tuple(hi - lo for lo, hi, _ in corner)), names[mask]))
    return merge_cells(cells)
