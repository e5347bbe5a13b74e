"""``[train] compile = true``: blocks compiled with ``torch.compile`` train to the eager losses.

A part of the 2-process ``world2`` job runs each layout (DDP data parallel; tensor parallel with DTensor
parameters) for three steps eagerly and three steps with every block compiled by inductor (or
aot_eager where no C++ compiler is found, as the runtime would), from the same weights and
batches; the losses must agree within fp32 noise, and dynamo must have compiled and run graphs
(the first step runs eagerly under the collective counter, the later ones compiled).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.world import Part, part_folder

pytestmark = pytest.mark.dist

WORLD, SEQ, STEPS, SEED = 2, 16, 3, 11
LAYOUTS = {"dp2": {"dp": 2}, "tp2": {"tp": 2}}
REL_TOL = 1e-5  # fp32: compiled kernels reassociate sums (measured ~1e-7 on gpt-tiny)


def compile_part(rank: int, world: int, out: Path) -> None:
    import torch
    from torch._dynamo.utils import counters

    from meshmorph.run.parallel.compile import compile_blocks, resolve_backend
    from meshmorph.run.config import OptimConfig
    from meshmorph.run.engine.train_engine import build_engine
    from meshmorph.spec.catalog import catalog_model
    from meshmorph.spec.plan import Plan

    device = torch.device("cpu")
    model = catalog_model("gpt-tiny", seq_len=SEQ)
    optim = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=1, decay_steps=10)
    backend = resolve_backend("inductor", device).backend
    results: dict[str, dict[str, object]] = {}
    for name, layout in LAYOUTS.items():
        dp = layout.get("dp", 1)
        plan = Plan(model="gpt-tiny", seq_len=SEQ, global_batch=2 * dp, num_microbatches=2,
                    dtype="fp32", **layout).with_even_stages(model)
        losses = {}
        for mode in ("eager", "compiled"):
            engine = build_engine(model, plan, optim, seed=SEED, device=device)
            before = counters["stats"]["unique_graphs"]
            if mode == "compiled":
                compile_blocks(engine.model_parts, backend)
            generator = torch.Generator().manual_seed(SEED + engine.dp_rank)
            losses[mode] = [engine.step(torch.randint(0, model.vocab_size,
                                                      (plan.global_batch // plan.dp, SEQ + 1),
                                                      generator=generator))
                            for _ in range(STEPS)]
            graphs = counters["stats"]["unique_graphs"] - before
        results[name] = {**losses, "graphs": graphs, "backend": backend}
    if rank == 0:
        (out / "losses.json").write_text(json.dumps(results))


WORLD_PARTS = [Part("compile_run", compile_part, world=WORLD, timeout_s=600)]


@pytest.mark.timeout(60, func_only=True)
def test_compiled_blocks_train_to_the_eager_losses(world2: Path) -> None:
    results = json.loads((part_folder(world2, "compile_run") / "losses.json").read_text())
    assert sorted(results) == sorted(LAYOUTS)
    for name, r in results.items():
        assert r["graphs"] > 0, f"{name}: no block was compiled by {r['backend']}"
        for step, (eager, compiled) in enumerate(zip(r["eager"], r["compiled"], strict=True)):
            rel = abs(compiled - eager) / abs(eager)
            assert rel <= REL_TOL, (f"{name} ({r['backend']}) step {step + 1}: compiled loss "
                                    f"{compiled!r} vs eager {eager!r}, rel {rel:.2e} > {REL_TOL}")
