"""Layout agrees with what the runtime really holds: for every layout of the equivalence matrix,
plus four whose rows dp does not divide, each rank of the 4-process ``world4`` job compares
Layout's pieces with its live local shards — the key set, every parameter's box (shape, global
offset from the DTensor placements, the values its initialisation gives that box, and under
FSDP2 the padded rows it allocates) and, after one step, every AdamW moment's box and again
every parameter's — and the small state (step counter, LR schedule, RNG stream).

The matrix layouts are checked on the engines the equivalence matrix trains
(``tests/helpers/matrix.py``: the check's step is the matrix's first step), the uneven ones on
engines of their own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshmorph.elastic.moves.layout import layout_of
from tests.helpers.matrix import (
    MATRIX_PART,
    UNEVEN_PART,
    WORLD,
    Layout,
    layouts,
    uneven_layouts,
)

WORLD_PARTS = [MATRIX_PART, UNEVEN_PART]

RUNTIME_BUGS: dict[str, str] = {}
"""Layouts the runtime cannot run yet, with the reason (an expected failure each)."""

ALL = [(MATRIX_PART.name, layout) for layout in layouts()] + \
    [(UNEVEN_PART.name, layout) for layout in uneven_layouts()]


def _found(world4: Path, part: str, name: str, rank: int) -> dict:
    """What one rank found for one layout; a rank that failed before writing it fails the test
    with its traceback."""
    folder = world4 / part / name
    path = folder / f"live-rank{rank}.json"
    if not path.is_file():
        errors = "\n".join(e.read_text() for e in sorted(folder.glob("error*.txt")))
        pytest.fail(f"rank {rank} did not check {name}:\n{errors or '(no error file)'}")
    return json.loads(path.read_text())


@pytest.mark.dist
@pytest.mark.timeout(60, func_only=True)
@pytest.mark.parametrize("part, layout", [
    pytest.param(p, layout, id=layout.name,
                 marks=[pytest.mark.xfail(reason=RUNTIME_BUGS[layout.name], strict=True)]
                 if layout.name in RUNTIME_BUGS else []) for p, layout in ALL])
def test_layout_boxes_equal_the_live_shards_of_every_rank(part: str, layout: Layout,
                                                          world4: Path) -> None:
    expected = layout_of(layout.model, layout.plan)
    for rank in range(WORLD):
        found = _found(world4, part, layout.name, rank)
        assert found["mismatch"] == [], f"rank {rank}: " + "\n".join(found["mismatch"])
        assert (found["only_live"], found["only_layout"]) == ([], []), f"rank {rank}"
        tensors = {p.key for p in expected.held[rank]
                   if "/" in p.key and not p.key.startswith("rng/")}
        assert set(found["boxes"]) == tensors, f"rank {rank}: boxes not compared"
        params = {k for k in tensors if k.startswith("param/")}
        assert set(found["values"]) == params
        fsdp = layout.plan.zero >= 2 and layout.plan.dp > 1
        assert set(found["padded"]) == (params if fsdp else set())
