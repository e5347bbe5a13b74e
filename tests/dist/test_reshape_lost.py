"""An unplanned loss: a rank's process is gone with its ZeRO-3 shards, the survivors rebuild a new
plan in memory, and the pieces nobody alive holds come from the newest committed checkpoint by a
partial DCP read of just those pieces (``elastic/live/checkpoint_pieces.py``).

A part of the 4-process ``world4`` job (fp32, gpt-tiny): one step under ZeRO-3 dp4, a checkpoint, then
process 3 stops taking part (``lost=(3,)``) and processes 0-2 reshape to ZeRO-3 dp2. Every
tensor's hash after the move equals its hash before it, the checkpoint supplied exactly what
rank 3 alone held, and the new plan trains a step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.oracle import OPTIM, SEED, even_plan, gpt_tiny
from tests.helpers.reshape import GLOBAL_BATCH, WORLD
from tests.helpers.world import Part, part_folder


def lost_part(rank: int, world_size: int, out: Path) -> None:
    import torch.distributed as dist

    from meshmorph.elastic.live.controller import ReshapeRequest, regroup, reshape_in_memory
    from meshmorph.elastic.moves.layout import layout_of
    from meshmorph.elastic.live.local_state import extract_state, state_hashes
    from meshmorph.run.checkpoint import save_checkpoint
    from meshmorph.run.engine.train_engine import build_engine

    gpt = gpt_tiny()
    plan_a = even_plan(gpt, dp=4, zero=3, global_batch=GLOBAL_BATCH, num_microbatches=2)
    plan_b = even_plan(gpt, dp=2, zero=3, global_batch=GLOBAL_BATCH, num_microbatches=4)
    engine = build_engine(gpt, plan_a, OPTIM, seed=SEED, device=torch.device("cpu"))
    tokens = torch.randint(0, gpt.vocab_size, (GLOBAL_BATCH, gpt.seq_len + 1),
                           generator=torch.Generator().manual_seed(7))
    share = GLOBAL_BATCH // engine.dp_size
    engine.step(tokens[engine.dp_rank * share:(engine.dp_rank + 1) * share])
    folder = save_checkpoint(engine, out / "ckpt", step=1, consumed_samples=GLOBAL_BATCH,
                             plan=plan_a.to_dict(), keep=1)
    small = extract_state(engine, consumed_samples=GLOBAL_BATCH).small
    before = state_hashes(engine, small)
    if rank == 0:
        (out / "before.json").write_text(json.dumps(before))
        only_rank3 = layout_of(gpt, plan_a).bytes_on(3)
        (out / "rank3.json").write_text(json.dumps(only_rank3))
    if rank == 3:  # gone: takes no part in the move (it only meets the others at the end)
        regroup(out, "end", rank, list(range(world_size)))
        return
    request = ReshapeRequest(model=gpt, optim=OPTIM, plan_a=plan_a, processes_a=(0, 1, 2, 3),
                             plan_b=plan_b, lost=(3,), checkpoint=folder, seed=99)
    engine, report = reshape_in_memory(request, rank, engine, consumed_samples=GLOBAL_BATCH,
                                       store_dir=out, tag="lost")
    if engine is None:
        regroup(out, "end", rank, list(range(world_size)))
        return
    small = extract_state(engine, consumed_samples=GLOBAL_BATCH).small
    after = state_hashes(engine, small)
    share = GLOBAL_BATCH // engine.dp_size
    loss = engine.step(tokens[engine.dp_rank * share:(engine.dp_rank + 1) * share])
    if dist.get_rank() == 0:
        (out / "after.json").write_text(json.dumps(
            {**report.figures(), "hashes": after, "processes": report.processes_b,
             "loss": float(loss)}))
    regroup(out, "end", rank, list(range(world_size)))


WORLD_PARTS = [Part("reshape_lost", lost_part, world=WORLD, timeout_s=150, regroups=True)]


@pytest.mark.dist
@pytest.mark.timeout(60, func_only=True)
def test_pieces_of_a_lost_rank_come_from_the_checkpoint(world4: Path) -> None:
    tmp_path = part_folder(world4, "reshape_lost")
    before = json.loads((tmp_path / "before.json").read_text())
    after = json.loads((tmp_path / "after.json").read_text())
    assert len(before) > 20
    changed = sorted(k for k in before if after["hashes"].get(k) != before[k])
    assert changed == [], f"{len(changed)} tensors changed in the move: {changed[:5]}"
    rank3 = json.loads((tmp_path / "rank3.json").read_text())
    assert after["from_checkpoint_bytes"] > 0
    assert after["sources"]["checkpoint"] == after["from_checkpoint_bytes"]
    assert 3 not in after["processes"]
    assert after["from_checkpoint_bytes"] <= rank3
    assert after["loss"] == after["loss"] and after["loss"] > 0  # the new plan trains
