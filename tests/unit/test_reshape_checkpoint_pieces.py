"""Pieces with no live holder read from a DCP checkpoint: only the saved chunks that overlap the
wanted boxes are read, and each piece equals that box of the saved tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from meshmorph.elastic.live.checkpoint_pieces import checkpoint_key, read_pieces
from meshmorph.elastic.moves.box import Box
from meshmorph.elastic.moves.placement import ReshapeError


def _save(path: Path) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    whole = {"param/embed.tok.weight": torch.randn(10, 6, generator=g),
             "param/blocks.0.mlp.fc.weight": torch.randn(8, 6, generator=g),
             "exp_avg/blocks.0.mlp.fc.weight": torch.randn(8, 6, generator=g),
             "exp_avg_sq/blocks.0.mlp.fc.weight": torch.rand(8, 6, generator=g)}
    state = {"model": {k.split("/", 1)[1]: v for k, v in whole.items() if k.startswith("param/")},
             "optim": {f"state.{k.split('/', 1)[1]}.{k.split('/', 1)[0]}": v
                       for k, v in whole.items() if not k.startswith("param/")}}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return whole


def test_boxes_come_back_equal_and_only_their_tensors_are_read(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    whole = _save(tmp_path)
    read: list[str] = []
    original = FileSystemReader.read_data

    def spy(self, plan, planner):  # type: ignore[no-untyped-def]
        read.extend(item.storage_index.fqn for item in plan.items)
        return original(self, plan, planner)

    monkeypatch.setattr(FileSystemReader, "read_data", spy)
    wanted = [("exp_avg/blocks.0.mlp.fc.weight", Box((2, 0), (3, 6))),
              ("exp_avg/blocks.0.mlp.fc.weight", Box((6, 1), (2, 4))),  # two boxes of one
              ("param/head.out.weight", Box((4, 0), (5, 6)))]  # tied: read as the embedding
    shapes = {k: tuple(v.shape) for k, v in whole.items()}
    shapes["param/head.out.weight"] = (10, 6)
    pieces = read_pieces(tmp_path, wanted, shapes)
    moment = whole["exp_avg/blocks.0.mlp.fc.weight"]
    assert torch.equal(pieces[0].tensor, moment[2:5, :])
    assert torch.equal(pieces[1].tensor, moment[6:8, 1:5])
    assert torch.equal(pieces[2].tensor, whole["param/embed.tok.weight"][4:9, :])
    assert [p.offset for p in pieces] == [(2, 0), (6, 1), (4, 0)]
    assert set(read) == {"optim.state.blocks.0.mlp.fc.weight.exp_avg", "model.embed.tok.weight"}


def test_a_key_the_checkpoint_lacks_is_refused(tmp_path: Path) -> None:
    whole = _save(tmp_path)
    shapes = {k: tuple(v.shape) for k, v in whole.items()} | {"param/blocks.9.x": (2,)}
    with pytest.raises(ReshapeError, match="does not hold model.blocks.9.x"):
        read_pieces(tmp_path, [("param/blocks.9.x", Box((0,), (2,)))], shapes)
    with pytest.raises(ReshapeError, match="not a tensor a checkpoint holds"):
        checkpoint_key("step/x")
