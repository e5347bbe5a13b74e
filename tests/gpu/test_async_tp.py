"""On two or more CUDA devices: a plan with ``tp_comm_overlap`` runs as torch's async tensor
parallel (inductor's micro-pipelined TP over compiled blocks) and trains to the losses of the same
plan without it.

Skipped with fewer than two CUDA devices (the CPU suite checks that CPU ranks refuse the plan,
and that the runtime turns inductor's pass on for it: tests/unit/test_compile_config.py).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

SEQ, STEPS, SEED = 64, 3, 5
REL_TOL = 2e-2  # bf16 autocast: the chunked GEMMs sum in another order


def _rank(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from meshmorph.run.config import OptimConfig
    from meshmorph.run.engine.train_engine import build_engine
    from meshmorph.run.parallel.compile import compile_blocks
    from meshmorph.spec.catalog import catalog_model
    from meshmorph.spec.plan import Plan

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    device = torch.device("cuda", rank)
    model = catalog_model("gpt-tiny", seq_len=SEQ)
    optim = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=1, decay_steps=10)
    base = Plan(model="gpt-tiny", seq_len=SEQ, global_batch=2, num_microbatches=1, tp=world,
                sequence_parallel=True, dtype="bf16", compile=True).with_even_stages(model)
    losses = {}
    for overlap in (False, True):
        plan = replace(base, tp_comm_overlap=overlap)
        torch._dynamo.reset()  # the blocks share one code object: compile afresh, pass on or off
        engine = build_engine(model, plan, optim, seed=SEED, device=device)
        compile_blocks(engine.model_parts, "inductor", async_tp=overlap)
        generator = torch.Generator().manual_seed(SEED)
        losses[str(overlap)] = [engine.step(torch.randint(
            0, model.vocab_size, (plan.global_batch, SEQ + 1), generator=generator).to(device))
            for _ in range(STEPS)]
    if rank == 0:
        Path(out).write_text(json.dumps(losses))
    dist.destroy_process_group()


@pytest.mark.timeout(600)
def test_async_tp_trains_to_the_losses_of_plain_tp(tmp_path: Path) -> None:
    out = tmp_path / "losses.json"
    mp.spawn(_rank, args=(2, 29517, str(out)), nprocs=2, join=True)
    losses = json.loads(out.read_text())
    for step, (plain, overlapped) in enumerate(zip(losses["False"], losses["True"],
                                                   strict=True)):
        rel = abs(overlapped - plain) / abs(plain)
        assert rel <= REL_TOL, f"step {step + 1}: async TP loss {overlapped} vs {plain}"
