"""The runtime's overlap switches change when gradients are reduced and what FSDP2 prefetches,
never the training: each switch on and off gives the same losses and an exact state line.

A part of the 2-process ``world2`` job trains each layout for three steps (each rank rebuilds
its engine per layout) and writes its losses and its ``state`` line per layout.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch

from meshmorph.run.config import OptimConfig
from meshmorph.spec.catalog import catalog_model
from meshmorph.spec.model import ModelSpec
from meshmorph.spec.plan import Plan
from tests.helpers.harness import each_case
from tests.helpers.world import Part, part_folder

WORLD = 2
SEQ = 16
SEED = 3
STEPS = 3
OPTIM = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=1, decay_steps=10, grad_clip=1.0)


def _model() -> ModelSpec:
    return catalog_model("gpt-tiny", seq_len=SEQ)


def _plan(**kw: object) -> Plan:
    return Plan(model="gpt-tiny", seq_len=SEQ, dp=2, num_microbatches=2, global_batch=4,
                **kw).with_even_stages(_model())  # type: ignore[arg-type]


LAYOUTS: dict[str, Plan] = {
    "zero0_overlap": _plan(zero=0, dtype="fp32"),
    "zero0_after_backward": _plan(zero=0, dtype="fp32", overlap_grad_reduce=False),
    "zero1_bf16_overlap": _plan(zero=1, dtype="bf16", reduce_dtype="bf16"),
    "zero1_bf16_after_backward": _plan(zero=1, dtype="bf16", reduce_dtype="bf16",
                                       overlap_grad_reduce=False),
    "zero1_bf16_gather_apart": _plan(zero=1, dtype="bf16", reduce_dtype="bf16",
                                     overlap_param_gather=False),
    "zero2_gather_overlap": _plan(zero=2, dtype="fp32"),
    "zero2_gather_apart": _plan(zero=2, dtype="fp32", overlap_param_gather=False),
    "zero3_prefetch": _plan(zero=3, dtype="fp32"),
    "zero3_no_prefetch": _plan(zero=3, dtype="fp32", fsdp_prefetch=False),
}
PAIRS = [("zero0_overlap", "zero0_after_backward"),
         ("zero1_bf16_overlap", "zero1_bf16_after_backward"),
         ("zero1_bf16_overlap", "zero1_bf16_gather_apart"),
         ("zero2_gather_overlap", "zero2_gather_apart"),
         ("zero3_prefetch", "zero3_no_prefetch")]


def _one_layout(name: str, plan: Plan, rank: int, folder: Path) -> None:
    from meshmorph.run.engine.state_line import write_state_line
    from meshmorph.run.engine.train_engine import build_engine
    from meshmorph.run.metrics import MetricsLogger

    model = _model()
    engine = build_engine(model, plan, OPTIM, seed=SEED, device=torch.device("cpu"))
    generator = torch.Generator().manual_seed(rank)
    metrics = MetricsLogger(folder, enabled=rank == 0, total_steps=STEPS, start_step=0,
                            tokens_per_step=1)
    losses = []
    for _ in range(STEPS):
        tokens = torch.randint(0, model.vocab_size, (plan.global_batch // plan.dp, SEQ + 1),
                               generator=generator)
        losses.append(engine.step(tokens))
        write_state_line(engine, metrics)
    metrics.close()
    if rank == 0:
        (folder / "losses.json").write_text(json.dumps(losses))


def overlap_part(rank: int, world_size: int, out: Path) -> None:
    """Every layout in turn: three steps, the state line after each (written once)."""
    each_case(rank, out, [(name, partial(_one_layout, name, plan, rank))
                          for name, plan in LAYOUTS.items()])


WORLD_PARTS = [Part("overlap_switches", overlap_part, world=WORLD, timeout_s=300)]


@pytest.fixture(scope="module")
def results(world2: Path) -> dict[str, tuple[list[float], list[dict]]]:
    out = part_folder(world2, "overlap_switches")
    found = {}
    for name in LAYOUTS:
        errors = sorted((out / name).glob("error*.txt"))
        assert not errors, "\n".join(e.read_text() for e in errors)
        records = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text()
                   .splitlines() if line.strip()]
        states = [r for r in records if r.get("event") == "state"]
        assert len(states) == 1, f"{name}: expected one state line, got {len(states)}"
        found[name] = (json.loads((out / name / "losses.json").read_text()), states[0]["ranks"])
    return found


@pytest.mark.dist
@pytest.mark.timeout(60, func_only=True)
@pytest.mark.parametrize("on, off", PAIRS)
def test_switch_off_trains_as_on(results: dict, on: str, off: str) -> None:
    losses_on, losses_off = results[on][0], results[off][0]
    assert len(losses_on) == STEPS
    assert losses_off == pytest.approx(losses_on, rel=1e-6, abs=1e-7), (on, off)


@pytest.mark.dist
@pytest.mark.timeout(60, func_only=True)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_state_line_is_exact_with_every_switch(results: dict, layout: str) -> None:
    for record in results[layout][1]:
        measured, predicted = record["measured"], record["predicted"]
        for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "peak_state_bytes"):
            assert measured[key] == predicted[key], (layout, record["rank"], key)
        assert measured["comm_bytes"] == predicted["comm_bytes"], (layout, record["rank"])
