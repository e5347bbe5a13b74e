"""Read just the pieces no live device holds from a committed DCP checkpoint.

A MovePlan's ``from_checkpoint`` transfers name boxes that died with their devices. Each process
loads only its boxes, without a process group (``no_dist``): the load planner asks, per box, for
its overlap with the saved chunks (``create_read_items_for_chunk_list``, DCP's own resharding
rule), so DCP reads only the saved chunks that overlap a box (each whole, then narrowed).

Keys: ``param/<fqn>`` is ``model.<fqn>``; ``exp_avg/<fqn>`` is ``optim.state.<fqn>.exp_avg``
(``run/checkpoint`` saves the flattened optimizer state under ``optim``); a tied head that a
checkpoint without pipeline parallelism holds only as its embedding is read from the embedding.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from meshmorph.elastic.live.local_state import HeldPiece, ReshapeError
from meshmorph.elastic.moves.box import Box
from meshmorph.run.checkpoint import TIED_EMBEDDING, TIED_HEAD


def checkpoint_key(key: str) -> str:
    """The DCP key of a Layout key (``param/x`` -> ``model.x``, ``exp_avg/x`` ->
    ``optim.state.x.exp_avg``)."""
    kind, _, fqn = key.partition("/")
    if kind == "param":
        return f"model.{fqn}"
    if kind in ("exp_avg", "exp_avg_sq"):
        return f"optim.state.{fqn}.{kind}"
    raise ReshapeError(f"{key} is not a tensor a checkpoint holds as a piece (param/, exp_avg/, "
                       "exp_avg_sq/)")


class _BoxPlanner(DefaultLoadPlanner):
    """Fills each buffer of the state dict (named ``slot``) with the box at ``offset`` of the
    saved tensor ``requests[slot] = (dcp key, offset)``: two boxes of one tensor are two slots."""

    def __init__(self, requests: dict[str, tuple[str, tuple[int, ...]]]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.requests = requests

    def create_local_plan(self) -> LoadPlan:
        items: list[ReadItem] = []
        for slot, buffer in self.state_dict.items():
            name, offset = self.requests[slot]
            saved = self.metadata.state_dict_metadata.get(name) if self.metadata else None
            if not isinstance(saved, TensorStorageMetadata):
                raise ReshapeError(f"the checkpoint holds no tensor {name}; it was saved by "
                                   "another model (check --resume's folder)")
            chunk = ChunkStorageMetadata(offsets=torch.Size(offset),
                                         sizes=torch.Size(buffer.shape))
            for item in create_read_items_for_chunk_list(name, saved, [chunk]):
                where = MetadataIndex(slot, item.dest_index.offset, item.dest_index.index)
                items.append(replace(item, dest_index=where))
        return LoadPlan(items)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        buffer = self.state_dict[read_item.dest_index.fqn]
        index = tuple(slice(o, o + n) for o, n in
                      zip(read_item.dest_offsets, read_item.lengths, strict=True))
        return buffer[index] if index else buffer


def read_pieces(path: Path, wanted: Iterable[tuple[str, Box]], global_shapes: dict[str, Any],
                dtype: torch.dtype = torch.float32) -> list[HeldPiece]:
    """The pieces ``wanted`` (Layout key, box) read from the committed checkpoint at ``path``
    (a ``step-N`` folder), each as a new tensor of its box's shape."""
    wanted = list(wanted)
    if not wanted:
        return []
    saved = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    buffers: dict[str, torch.Tensor] = {}
    requests: dict[str, tuple[str, tuple[int, ...]]] = {}
    for i, (key, box) in enumerate(wanted):
        name = checkpoint_key(key)
        if name not in saved and TIED_HEAD in name:
            name = name.replace(TIED_HEAD, TIED_EMBEDDING)
        if name not in saved:
            raise ReshapeError(f"{key} {box} has no live holder and the checkpoint {path} does "
                               f"not hold {name}; resume from an older checkpoint that does")
        buffers[f"box{i}"] = torch.empty(tuple(box.length), dtype=dtype)
        requests[f"box{i}"] = (name, tuple(box.offset))
    dcp.load(buffers, checkpoint_id=str(path), planner=_BoxPlanner(requests), no_dist=True)
    return [HeldPiece(key, tuple(box.offset), tuple(global_shapes[key]), buffers[f"box{i}"])
            for i, (key, box) in enumerate(wanted)]
