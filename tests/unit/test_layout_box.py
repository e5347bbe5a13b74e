"""Box: intersection, difference and row cuts against element masks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshmorph.elastic.moves.box import Box
from meshmorph.elastic.moves.box_cells import cover

SHAPE = (7, 5)


@st.composite
def boxes(draw: st.DrawFn) -> Box:
    lo = [draw(st.integers(0, n)) for n in SHAPE]
    return Box(tuple(lo), tuple(draw(st.integers(0, n - o)) for o, n in zip(lo, SHAPE, strict=True)))


def mask(box: Box) -> np.ndarray:
    out = np.zeros(SHAPE, dtype=bool)
    out[box.slices()] = True
    return out


@settings(max_examples=300, deadline=None)
@given(boxes(), boxes())
def test_intersect_and_minus_agree_with_element_masks(a: Box, b: Box) -> None:
    common = a.intersect(b)
    assert (mask(common) if common is not None else np.zeros(SHAPE, bool)).tolist() == \
        (mask(a) & mask(b)).tolist()
    parts = a.minus(b)
    count = sum(mask(p).astype(int) for p in parts) if parts else np.zeros(SHAPE, int)
    assert count.tolist() == (mask(a) & ~mask(b)).astype(int).tolist()  # disjoint, exact
    assert len(parts) <= 2 * a.ndim
    assert a.contains(common) if common is not None else True


@settings(max_examples=200, deadline=None)
@given(boxes(), st.lists(boxes(), max_size=4))
def test_cover_cells_are_disjoint_and_name_exactly_the_sources_holding_them(
        needed: Box, held: list[Box]) -> None:
    sources = list(enumerate(held))
    cells = cover(needed, sources)
    count = sum((mask(c).astype(int) for c, _ in cells), np.zeros(SHAPE, int))
    assert count.tolist() == mask(needed).astype(int).tolist() or needed.numel == 0
    for cell, who in cells:
        assert who == {d for d, box in sources if box.contains(cell)}


def test_split_rows_cuts_dim_zero() -> None:
    head, tail = Box((2, 1), (5, 3)).split_rows(2)
    assert (head, tail) == (Box((2, 1), (2, 3)), Box((4, 1), (3, 3)))
    with pytest.raises(ValueError, match="cannot cut 5 rows"):
        Box((0, 0), (5, 3)).split_rows(5)
    assert str(Box((2, 1), (2, 3))) == "[2:4, 1:4]" and Box((), ()).numel == 1
