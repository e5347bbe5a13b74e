"""Where state goes and where it comes from: which physical device each new logical rank runs
on (the placement that leaves the fewest bytes to receive: ``scipy.optimize.linear_sum_assignment``
on the receive matrix), and which live replica sends each needed cell (``balance_senders``).

``receive[r, j]``: bytes new rank ``r`` needs that device ``j`` does not already hold (a device
that joins holds nothing). A new rank's bytes do not depend on where the others go, so the
assignment problem's optimum is exactly the lower bound on the bytes any placement must move.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

import numpy as np

from meshmorph.elastic.moves.box import Box
from meshmorph.elastic.moves.layout import DTYPE_BYTES, Layout


class ReshapeError(ValueError):
    """A reshape that cannot be planned or completed: the message names the constraint or the
    piece that failed (the one error type of elastic/, planning and live execution alike)."""


def held_boxes(layout: Layout, rank: int) -> dict[str, Box]:
    """What ``rank`` holds under ``layout``, by key (one box per key)."""
    boxes: dict[str, Box] = {}
    for piece in layout.held.get(rank, ()):
        if piece.key in boxes and boxes[piece.key] != piece.box:
            raise ReshapeError(f"rank {rank} holds two different boxes of {piece.key}; a rank "
                               "must hold one box per tensor")
        boxes[piece.key] = piece.box
    return boxes


def device_holdings(layout_a: Layout, devices: Sequence[int],
                    survivors: Sequence[int]) -> list[dict[str, Box]]:
    """Per device (in ``devices`` order) what it holds under Layout A: a survivor holds its old
    rank's pieces, a joining device nothing."""
    alive = set(survivors)
    return [held_boxes(layout_a, d) if d in alive else {} for d in devices]


def moved_keys(layout_a: Layout, layout_b: Layout) -> set[str]:
    """Keys of Layout B that also exist in Layout A (the others are created fresh: a new
    rank's RNG stream)."""
    return {key for key in layout_b.tensors if key in layout_a.tensors}


def _boxes(pairs: list[tuple[int, Box]], ndim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(indices, offsets [n, ndim], stops [n, ndim]) of (index, box) pairs, as arrays."""
    index = np.array([i for i, _ in pairs], dtype=np.int64)
    offsets = np.array([b.offset for _, b in pairs], dtype=np.int64).reshape(len(pairs), ndim)
    lengths = np.array([b.length for _, b in pairs], dtype=np.int64).reshape(len(pairs), ndim)
    return index, offsets, offsets + lengths


def receive_matrix(layout_a: Layout, layout_b: Layout,
                   holdings: Sequence[Mapping[str, Box]]) -> np.ndarray:
    """``[new rank, device]`` bytes the rank would have to receive on that device: all its bytes,
    less per tensor the overlap of its box with the device's (vectorised over ranks x devices)."""
    keys = moved_keys(layout_a, layout_b)
    matrix = np.zeros((layout_b.world_size, len(holdings)), dtype=np.int64)
    wanted: dict[str, list[tuple[int, Box]]] = {}
    for rank in range(layout_b.world_size):
        for piece in layout_b.held[rank]:
            if piece.key in keys:
                size = DTYPE_BYTES[layout_b.tensors[piece.key].dtype]
                matrix[rank, :] += piece.box.numel * size
                wanted.setdefault(piece.key, []).append((rank, piece.box))
    have: dict[str, list[tuple[int, Box]]] = {}
    for column, held in enumerate(holdings):
        for key, box in held.items():
            if key in wanted:
                have.setdefault(key, []).append((column, box))
    for key, pairs in have.items():
        ndim = len(layout_b.tensors[key].shape)
        ranks, lo_b, hi_b = _boxes(wanted[key], ndim)
        columns, lo_a, hi_a = _boxes(pairs, ndim)
        # overlap[i, j] = prod over dims of max(0, min(stops) - max(offsets))
        extent = np.minimum(hi_b[:, None, :], hi_a[None, :, :]) - \
            np.maximum(lo_b[:, None, :], lo_a[None, :, :])
        overlap = np.clip(extent, 0, None).prod(axis=2) * DTYPE_BYTES[layout_b.tensors[key].dtype]
        np.subtract.at(matrix, (ranks[:, None], columns[None, :]), overlap)
    return matrix


def _check_devices(needed: int, available: int) -> None:
    if available < needed:
        raise ReshapeError(f"the new plan needs {needed} devices but only {available} are "
                           "available; choose a smaller plan or add devices")


def best_placement(receive: np.ndarray, devices: Sequence[int]) -> dict[int, int]:
    """New rank -> device minimising the total bytes received (``linear_sum_assignment``)."""
    from scipy.optimize import linear_sum_assignment  # scipy: imported where a move is planned

    _check_devices(*receive.shape)
    rows, cols = linear_sum_assignment(receive)
    return {int(r): int(devices[c]) for r, c in zip(rows, cols, strict=True)}


def rank_order_placement(layout_b: Layout, devices: Sequence[int]) -> dict[int, int]:
    """The naive (Megatron-style) placement: new rank ``r`` on the ``r``-th device in id order."""
    ordered = sorted(devices)
    _check_devices(layout_b.world_size, len(ordered))
    return {rank: ordered[rank] for rank in range(layout_b.world_size)}


def placement_bytes(receive: np.ndarray, devices: Sequence[int],
                    placement: Mapping[int, int]) -> int:
    """Total bytes received under ``placement``."""
    column = {d: j for j, d in enumerate(devices)}
    return int(sum(receive[r, column[d]] for r, d in placement.items()))


def balance_senders(groups: Mapping[frozenset[int], int]) -> dict[frozenset[int], dict[int, float]]:
    """Bytes each sender sends of each group, minimising the busiest sender (an LP over
    ``y[group, sender] >= 0``: ``sum_s y[g, s] = bytes[g]``, ``sum_g y[g, s] <= T``, min T)."""
    from scipy.optimize import linprog  # scipy: imported where a move is planned

    pairs = [(g, s) for g in groups for s in sorted(g)]
    senders = sorted({s for g in groups for s in g})
    if not pairs:
        return {}
    scale = max(groups.values()) or 1  # bytes in units of the largest group: a well-scaled LP
    n = len(pairs)
    cost = np.zeros(n + 1)
    cost[-1] = 1.0
    a_eq = np.zeros((len(groups), n + 1))
    index = {g: i for i, g in enumerate(groups)}
    a_ub = np.zeros((len(senders), n + 1))
    column = {s: i for i, s in enumerate(senders)}
    for v, (g, s) in enumerate(pairs):
        a_eq[index[g], v] = 1.0
        a_ub[column[s], v] = 1.0
    a_ub[:, -1] = -1.0
    b_eq = np.array([groups[g] / scale for g in groups])
    result = linprog(cost, A_ub=a_ub, b_ub=np.zeros(len(senders)), A_eq=a_eq, b_eq=b_eq,
                     bounds=(0, None), method="highs")
    if not result.success:  # pragma: no cover - a feasible LP by construction
        raise ReshapeError(f"source balancing failed: {result.message}")
    shares: dict[frozenset[int], dict[int, float]] = defaultdict(dict)
    for v, (g, s) in enumerate(pairs):
        shares[g][s] = float(result.x[v]) * scale
    return shares


def assign_cells(cells: list[tuple[int, str, Box, int]], quota: dict[int, float]
            ) -> list[tuple[int, int, str, Box, int]]:
    """Give each cell (dst, key, box, element bytes) of one sender group to senders by their
    quota of bytes, cutting a cell along dim 0 where a sender's quota ends."""
    out = []
    for dst, key, box, size in cells:
        while True:
            src = max(sorted(quota), key=lambda s: quota[s])
            nbytes = box.numel * size
            row = box.row_numel() * size
            fits = quota[src] + row / 2 >= nbytes or box.ndim == 0 or box.length[0] == 1
            rows = int(round(quota[src] / row)) if not fits else 0
            if fits or rows <= 0:
                if not fits and quota[src] > 0 and any(q > row / 2 for s, q in quota.items()
                                                       if s != src):
                    quota[src] = 0.0  # less than half a row left: the next sender takes it
                    continue
                out.append((src, dst, key, box, nbytes))
                quota[src] -= nbytes
                break
            head, box = box.split_rows(rows)
            out.append((src, dst, key, head, head.numel * size))
            quota[src] -= head.numel * size
    return out
