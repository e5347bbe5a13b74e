"""The shape the memory-aware bounds need: one layer, a run of identical blocks, one layer."""

from __future__ import annotations

from dataclasses import dataclass

from meshmorph.cost.layer_cost import layer_classes
from meshmorph.spec.model import LayerKind, ModelSpec


@dataclass(frozen=True, slots=True)
class BlockRun:
    """The model as one layer before, a run of identical blocks, and one layer after."""

    first: int
    """Index of the first block."""
    count: int
    """Number of blocks."""
    prefix: tuple[int, ...]
    """Layers before the blocks (at most one: it sits on pipeline rank 0)."""
    suffix: tuple[int, ...]
    """Layers after the blocks (at most one: it sits on the last pipeline rank)."""

    def least_blocks(self, pp: int) -> list[int]:
        """Fewest blocks per pipeline rank: a middle rank holds at least one layer, so one block;
        the first and last hold the layer before and after (when there is one)."""
        return [0 if (k == 0 and self.prefix) or (k == pp - 1 and self.suffix) else 1
                for k in range(pp)]


_BLOCK_RUNS: dict[int, tuple[ModelSpec, BlockRun | None]] = {}


def block_run(model: ModelSpec) -> BlockRun | None:
    """The model's run of alike blocks, or None when its layers have another shape."""
    known = _BLOCK_RUNS.get(id(model))
    if known is None or known[0] is not model:
        if len(_BLOCK_RUNS) > 64:
            _BLOCK_RUNS.clear()
        known = _BLOCK_RUNS[id(model)] = (model, _block_run(model))
    return known[1]


def _block_run(model: ModelSpec) -> BlockRun | None:
    classes = layer_classes(model)
    blocks = [i for i, layer in enumerate(model.layers) if layer.kind == LayerKind.BLOCK]
    if not blocks or blocks != list(range(blocks[0], blocks[-1] + 1)):
        return None
    if len({classes[i] for i in blocks}) != 1:
        return None
    prefix = tuple(range(blocks[0]))
    suffix = tuple(range(blocks[-1] + 1, model.num_layers))
    if len(prefix) > 1 or len(suffix) > 1:
        return None
    return BlockRun(blocks[0], len(blocks), prefix, suffix)
