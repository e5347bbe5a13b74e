"""A reshape's new engine is built without drawing initial values (``state_installed_after``):
its storage starts at zero, and once the moved state is installed every tensor's hash equals the
engine it came from, for a ZeRO-3 (padded dim-0 shards) and a tp2 plan on the 2 gloo processes
of the ``world2`` job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.oracle import OPTIM, SEED, even_plan, gpt_tiny
from tests.helpers.world import Part, part_folder


def build_part(rank: int, world_size: int, out: Path) -> None:
    from meshmorph.elastic.live.local_state import extract_state, install_state, state_hashes
    from meshmorph.run.engine.train_engine import build_engine
    from meshmorph.run.model.materialize import state_installed_after

    gpt = gpt_tiny()
    results = {}
    for name, kw in {"zero3": dict(dp=2, zero=3, micro_batch=1),
                     "tp2": dict(tp=2, micro_batch=2)}.items():
        plan = even_plan(gpt, global_batch=4, num_microbatches=2, **kw)
        engine = build_engine(gpt, plan, OPTIM, seed=SEED, device=torch.device("cpu"))
        tokens = torch.randint(0, gpt.vocab_size, (4, gpt.seq_len + 1),
                               generator=torch.Generator().manual_seed(1))
        share = 4 // engine.dp_size
        engine.step(tokens[engine.dp_rank * share:(engine.dp_rank + 1) * share])
        state = extract_state(engine, consumed_samples=4)
        with state_installed_after():
            blank = build_engine(gpt, plan, OPTIM, seed=SEED, device=torch.device("cpu"))
        zero = all(float(p.detach().abs().sum()) == 0.0
                   for part in blank.model_parts for p in part.parameters())
        install_state(blank, state.pieces, state.small)
        results[name] = {"zero": zero, "equal": state_hashes(blank, state.small)
                         == state_hashes(engine, state.small)}
    (out / f"result{rank}.json").write_text(json.dumps(results))


WORLD_PARTS = [Part("reshape_build", build_part, world=2, timeout_s=120)]


@pytest.mark.dist
@pytest.mark.timeout(60, func_only=True)
def test_a_reshape_engine_starts_blank_and_holds_the_moved_state_exactly(world2: Path) -> None:
    out = part_folder(world2, "reshape_build")
    for rank in range(2):
        got = json.loads((out / f"result{rank}.json").read_text())
        assert got == {"zero3": {"zero": True, "equal": True},
                       "tp2": {"zero": True, "equal": True}}, (rank, got)
