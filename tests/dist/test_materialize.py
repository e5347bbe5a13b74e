"""Meta-device init: every rank's materialised shards are exactly the one-device model's slices.

A part of the 4-process ``world4`` job builds engines (meta device, parallelize, ``materialize_``) for a
small GPT (tied head, vocabulary 251 padded to 256) and a small Llama (vocabulary 251 left
unpadded, odd FFN width, so FSDP2 pads its dim-0 shards) under 1-D tensor parallelism (tp 2 with
pp 2), 1-D FSDP2 (dp 2 with pp 2, and dp 4), 2-D dp 2 x tp 2 and DDP (dp 4, zero 0). Each rank
compares every local shard with the slice of ``build_model``'s tensor at the positions the
DTensor says it holds, and (without pp) one forward against the reference logits, which proves
FSDP2 and DDP run the materialised values. Every case runs twice: with the real initialisation
block (1 MiB: every tensor of these small models is one block) and with 384-byte blocks (three
rows of width 32), so shard bounds fall inside and across blocks, for row shards, FSDP2's padded
shards and the column split of row-parallel weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from meshmorph.spec.model import ModelSpec
from meshmorph.spec.plan import Plan
from meshmorph.spec.transformer import TransformerShape, build_transformer
from tests.helpers.world import Part, collect, part_folder

WORLD = 4
SEED = 11
SEQ = 9  # odd: GPT's learned position table splits unevenly over dp


def _gpt() -> ModelSpec:
    return build_transformer(TransformerShape(name="gpt-mat", arch="gpt", num_layers=2,
                                              hidden_size=32, num_heads=4, vocab_size=251,
                                              seq_len=SEQ))


def _llama() -> ModelSpec:
    return build_transformer(TransformerShape(name="llama-mat", arch="llama", num_layers=2,
                                              hidden_size=32, num_heads=4, num_kv_heads=2,
                                              ffn_hidden_size=90, vocab_size=251,
                                              padded_vocab_size=251, seq_len=SEQ))


BLOCK_BYTES = {"1mib": 2**20, "384b": 384}
"""Initialisation block sizes each case runs under (``models.INIT_BLOCK_BYTES``)."""

CASES = {  # name -> (model, plan degrees)
    "gpt_pp2_tp2": (_gpt, {"pp": 2, "tp": 2}),
    "gpt_pp2_dp2_zero3": (_gpt, {"pp": 2, "dp": 2, "zero": 3}),
    "gpt_dp2_tp2_zero3": (_gpt, {"dp": 2, "tp": 2, "zero": 3}),
    "gpt_dp4_zero0": (_gpt, {"dp": 4, "zero": 0}),
    "llama_pp2_tp2": (_llama, {"pp": 2, "tp": 2}),
    "llama_dp4_zero3": (_llama, {"dp": 4, "zero": 3}),
    "llama_dp2_tp2_zero1": (_llama, {"dp": 2, "tp": 2, "zero": 1}),
}


def _check_case(name: str, rank: int) -> dict[str, object]:
    from torch.distributed.tensor import DTensor

    from meshmorph.run.config import OptimConfig
    from meshmorph.run.engine.train_engine import build_engine
    from meshmorph.run.model.materialize import _local_box
    from meshmorph.run.model.decoder import build_model

    make, degrees = CASES[name]
    spec = make()
    dp = int(degrees.get("dp", 1))
    plan = Plan(model=spec.name, seq_len=SEQ, dtype="fp32", micro_batch=1, num_microbatches=2,
                global_batch=2 * dp, **degrees).with_even_stages(spec)  # type: ignore[arg-type]
    engine = build_engine(spec, plan, OptimConfig(), seed=SEED, device=torch.device("cpu"))
    reference = build_model(spec, seed=SEED)
    whole = dict(reference.named_parameters(remove_duplicate=False))  # tied head named too
    checked, mismatched, sharded, padded_rows = 0, [], 0, 0
    local_numel = 0
    for part in engine.model_parts:
        for pname, param in part.named_parameters():
            assert not param.is_meta, pname
            local, box = _local_box(param)
            expected = whole[pname].detach() if box is None else whole[pname].detach()[box]
            if isinstance(param, DTensor) and any(p.is_shard() for p in param.placements):
                sharded += 1
            if pname == "embed.tok.weight" and box is not None:
                padded_rows += max(0, min(box[0].stop, 256) - max(box[0].start, 251))
            local_numel += local.numel()
            checked += 1
            if not torch.equal(local, expected):
                mismatched.append(pname)
    logits_diff = None
    if plan.pp == 1:
        tokens = torch.randint(0, spec.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            ours = engine._runners[0](tokens)
            ref = reference(tokens)
        if isinstance(ours, DTensor):  # a vocabulary-parallel head keeps its logits sharded
            ours = ours.full_tensor()[..., : ref.shape[-1]]
        logits_diff = float((ours - ref).abs().max())
    return {"checked": checked, "mismatched": mismatched, "sharded": sharded,
            "local_numel": local_numel, "logits_diff": logits_diff, "padded_rows": padded_rows,
            "reference_numel": sum(p.numel() for p in reference.parameters())}


def materialize_part(rank: int, world_size: int, out: Path) -> None:
    """Every case under both block sizes; the runtime's block size is restored afterwards (the
    world's later parts build engines too)."""
    from meshmorph.run.model import decoder as models

    results: dict[str, dict[str, object]] = {}
    default = models.INIT_BLOCK_BYTES
    try:
        for blocks, block_bytes in BLOCK_BYTES.items():
            models.INIT_BLOCK_BYTES = block_bytes  # the reference and the shards alike
            for name in CASES:
                results[f"{name}/{blocks}"] = _check_case(name, rank)
                collect()
    finally:
        models.INIT_BLOCK_BYTES = default
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


WORLD_PARTS = [Part("materialize", materialize_part, world=WORLD, timeout_s=240)]


@pytest.fixture(scope="module")
def results(world4: Path) -> list[dict[str, dict]]:
    out = part_folder(world4, "materialize")
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.dist
@pytest.mark.timeout(60, func_only=True)
@pytest.mark.parametrize("blocks", list(BLOCK_BYTES))
@pytest.mark.parametrize("case", list(CASES))
def test_materialized_shards_equal_the_one_device_models_slices(
        results: list[dict[str, dict]], case: str, blocks: str) -> None:
    per_rank = [r[f"{case}/{blocks}"] for r in results]
    for rank, res in enumerate(per_rank):
        assert res["checked"] > 0
        assert res["mismatched"] == [], f"rank {rank}: {res['mismatched']}"
        if res["logits_diff"] is not None:  # forward through TP/FSDP2/DDP uses these values
            assert res["logits_diff"] < 1e-5, f"rank {rank}: logits differ by {res['logits_diff']}"
    _, degrees = CASES[case]
    if degrees.get("tp", 1) > 1 or degrees.get("zero", 0) >= 1:
        assert all(res["sharded"] > 0 for res in per_rank)
    if degrees.get("pp", 1) == 1 and degrees.get("tp", 1) == 1 and degrees.get("zero", 0) == 3:
        # sharded over every rank: each holds about a quarter (FSDP2 pads the last shards)
        total = sum(res["local_numel"] for res in per_rank)
        assert total == per_rank[0]["reference_numel"] * 4 // degrees["dp"]


@pytest.mark.dist
@pytest.mark.timeout(60, func_only=True)
def test_padded_vocabulary_rows_start_at_zero_on_the_ranks_that_hold_them(
        results: list[dict[str, dict]]) -> None:
    # gpt: vocab 251 padded to 256; dp 2 x tp 2 splits the 256 rows into four blocks of 64, and
    # the last block (rows 192..255) holds the 5 padded rows
    for blocks in BLOCK_BYTES:
        held = [r[f"gpt_dp2_tp2_zero3/{blocks}"]["padded_rows"] for r in results]
        assert sorted(held) == [0, 0, 0, 5], blocks
