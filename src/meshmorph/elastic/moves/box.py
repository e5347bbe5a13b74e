"""Box: a hyper-rectangle of a tensor (offset and length per dimension), and the few operations
the move planner needs on boxes: size, intersection, difference, and cutting along dim 0.

A 0-dimensional tensor (a step counter) is the box ``Box((), ())`` of one element.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Box:
    """The elements ``offset[i] <= index[i] < offset[i] + length[i]`` of a tensor."""

    offset: tuple[int, ...]
    """First index along each dimension."""
    length: tuple[int, ...]
    """Number of indices along each dimension (0 in any dimension: an empty box)."""

    def __post_init__(self) -> None:
        if len(self.offset) != len(self.length):
            raise ValueError(f"box offset {self.offset} and length {self.length} differ in rank")
        if any(o < 0 for o in self.offset) or any(n < 0 for n in self.length):
            raise ValueError(f"box offset {self.offset} and length {self.length} must be >= 0")

    @classmethod
    def whole(cls, shape: tuple[int, ...]) -> Box:
        """The box of a whole tensor of ``shape``."""
        return cls((0,) * len(shape), tuple(shape))

    @property
    def ndim(self) -> int:
        return len(self.offset)

    @property
    def stop(self) -> tuple[int, ...]:
        """One past the last index along each dimension."""
        return tuple(o + n for o, n in zip(self.offset, self.length, strict=True))

    @property
    def numel(self) -> int:
        return math.prod(self.length)

    def slices(self) -> tuple[slice, ...]:
        """The box as one slice per dimension (for numpy and torch indexing)."""
        return self.slices_from((0,) * self.ndim)

    def slices_from(self, origin: Sequence[int]) -> tuple[slice, ...]:
        """The box as slices of a tensor holding the box that starts at ``origin``."""
        return tuple(slice(o - p, o - p + n)
                     for o, n, p in zip(self.offset, self.length, origin, strict=True))

    @classmethod
    def _trusted(cls, offset: tuple[int, ...], length: tuple[int, ...]) -> Box:
        """A box from bounds already known to be valid (no checks: the planner's hot path)."""
        box = object.__new__(cls)
        object.__setattr__(box, "offset", offset)
        object.__setattr__(box, "length", length)
        return box

    def contains(self, other: Box) -> bool:
        """Whether every element of ``other`` lies in this box."""
        if other.numel == 0:
            return True
        for a, n, b, m in zip(self.offset, self.length, other.offset, other.length, strict=True):
            if b < a or b + m > a + n:
                return False
        return True

    def intersect(self, other: Box) -> Box | None:
        """The common part of two boxes of the same tensor, None where they do not overlap."""
        if len(self.offset) != len(other.offset):
            raise ValueError(f"boxes of different rank cannot intersect: {self} and {other}")
        lo, length = [], []
        for a, n, b, m in zip(self.offset, self.length, other.offset, other.length, strict=True):
            start, stop = max(a, b), min(a + n, b + m)
            if stop <= start:
                return None
            lo.append(start)
            length.append(stop - start)
        return Box._trusted(tuple(lo), tuple(length))

    def minus(self, other: Box | None) -> list[Box]:
        """This box without ``other``: at most ``2 * ndim`` disjoint boxes (slab by slab: below and
        above ``other`` along dim 0, then along dim 1 inside dim 0's overlap, ...)."""
        common = self.intersect(other) if other is not None else None
        if common is None:
            return [self] if self.numel else []
        pieces, offset, length = [], list(self.offset), list(self.length)
        for dim in range(self.ndim):
            lo, hi = common.offset[dim], common.stop[dim]
            if lo > offset[dim]:  # the slab before the overlap along this dim
                pieces.append(Box(tuple(offset), tuple(length[:dim] + [lo - offset[dim]]
                                                       + length[dim + 1:])))
            end = offset[dim] + length[dim]
            if hi < end:  # the slab after it
                pieces.append(Box(tuple(offset[:dim] + [hi] + offset[dim + 1:]),
                                  tuple(length[:dim] + [end - hi] + length[dim + 1:])))
            offset[dim], length[dim] = lo, hi - lo  # narrow to the overlap, go to the next dim
        return pieces

    def split_rows(self, rows: int) -> tuple[Box, Box]:
        """The first ``rows`` indices along dim 0, and the rest."""
        if self.ndim == 0 or not 0 < rows < self.length[0]:
            raise ValueError(f"cannot cut {rows} rows off {self}")
        head = Box(self.offset, (rows, *self.length[1:]))
        tail = Box((self.offset[0] + rows, *self.offset[1:]), (self.length[0] - rows, *self.length[1:]))
        return head, tail

    def row_numel(self) -> int:
        """Elements in one index along dim 0 (the whole box for a 0-d box)."""
        return math.prod(self.length[1:])

    def __str__(self) -> str:
        return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(self.offset, self.length,
                                                               strict=True)) + "]"
