"""dtype fp8 in the runtime (run/model/float8.py): exactly the transformer blocks' linear layers
become torchao's Float8Linear with the plan's recipe, before any parallelism, the embedding and
the head stay as they are, and every recipe trains under the runtime's two precision setups on
CPU (autocast over fp32 parameters; 16-bit parameters as FSDP2's mixed precision casts them).
Multi-process runs are tests/dist/test_fp8_run.py."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from torch import nn

from meshmorph.run.model.decoder import build_chunk, build_model
from meshmorph.run.model.float8 import (
    cast_inputs_under_autocast_,
    convert_for_plan_,
    torchao_float8,
)
from meshmorph.spec.catalog import catalog_model
from meshmorph.spec.plan import Plan

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def _plan(name: str, dtype: str = "fp8", scaling: str = "tensorwise") -> Plan:
    spec = catalog_model(name)
    plan = Plan(model=name, seq_len=spec.seq_len, global_batch=2, micro_batch=2,
                num_microbatches=1, dtype="bf16")
    return replace(plan, dtype=dtype, fp8_scaling=scaling if dtype == "fp8" else "tensorwise")


def _block_linears(module: nn.Module) -> set[str]:
    return {name for name, m in module.named_modules()
            if isinstance(m, nn.Linear) and name.startswith("blocks.")}


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_exactly_the_block_linears_become_float8_with_the_plans_recipe(name: str,
                                                                       recipe: str) -> None:
    spec = catalog_model(name)
    float8 = torchao_float8()
    chunk = build_chunk(spec, 0, spec.num_layers, seed=0, device="meta")  # as build_engine does
    names = [n for n, _ in chunk.named_parameters(remove_duplicate=False)]
    linears = _block_linears(chunk)
    converted = convert_for_plan_(chunk, _plan(name, scaling=recipe))
    per_block = 6 if name == "gpt-tiny" else 7  # q, k, v, o and the MLP's two (SwiGLU's three)
    assert set(converted) == linears and len(linears) == spec.num_blocks * per_block
    float8_linear = float8.float8_linear.Float8Linear
    found = {n: m for n, m in chunk.named_modules() if isinstance(m, float8_linear)}
    assert set(found) == linears
    expected = float8.Float8LinearConfig.from_recipe_name(recipe)
    assert all(m.config == expected for m in found.values())
    # the embedding and the output head keep their 16-bit modules (cost/fp8.py prices them so)
    assert type(chunk.head.out) is nn.Linear and type(chunk.embed.tok) is nn.Embedding
    assert not any(isinstance(m, float8_linear)
                   for n, m in chunk.named_modules() if not n.startswith("blocks."))
    # same parameters under the same names, still on the meta device, a tied head still tied
    assert [n for n, _ in chunk.named_parameters(remove_duplicate=False)] == names
    assert all(p.is_meta for p in chunk.parameters())
    if spec.tied_embeddings:
        assert chunk.head.out.weight is chunk.embed.tok.weight


def test_a_pipeline_chunk_converts_its_blocks_and_other_dtypes_nothing() -> None:
    spec = catalog_model("llama-tiny")
    middle = build_chunk(spec, 2, 4, seed=0, device="meta")  # blocks 1 and 2, no embed or head
    assert set(convert_for_plan_(middle, _plan("llama-tiny", scaling="rowwise"))) == \
        _block_linears(middle) and len(_block_linears(middle)) == 14
    for dtype in ("bf16", "fp32", "fp16"):
        chunk = build_chunk(spec, 0, spec.num_layers, seed=0, device="meta")
        assert convert_for_plan_(chunk, _plan("llama-tiny", dtype=dtype)) == []
        assert all(type(m) is nn.Linear for m in chunk.modules() if isinstance(m, nn.Linear))


def _grads(model: nn.Module, tokens: torch.Tensor, *, autocast: bool) -> dict[str, torch.Tensor]:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return {n: p.grad.float() for n, p in model.named_parameters()}


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("setup", ["autocast", "bf16_params"])
def test_every_recipe_trains_in_the_runtimes_precision_setups(recipe: str, setup: str) -> None:
    """``autocast``: fp32 parameters under CPU autocast (ZeRO-0, dp 1), where torchao alone
    leaves a CPU linear's input fp32 and ``rowwise_with_gw_hp``'s bf16 weight-gradient GEMM
    fails on it; ``bf16_params``: 16-bit parameters and inputs, as FSDP2's mixed precision runs
    ZeRO 1-3. The float8 gradients stay near the bf16 ones (measured 5-11% relative on these
    two block weights, recipe and setup alike; the bound leaves twice that)."""
    spec = catalog_model("gpt-tiny")
    tokens = torch.randint(0, spec.vocab_size, (2, spec.seq_len + 1),
                           generator=torch.Generator().manual_seed(0))
    autocast = setup == "autocast"
    dtype = torch.float32 if autocast else torch.bfloat16
    reference = _grads(build_model(spec, seed=1).to(dtype), tokens, autocast=autocast)
    model = build_model(spec, seed=1).to(dtype)
    assert convert_for_plan_(model, _plan("gpt-tiny", scaling=recipe))
    cast_inputs_under_autocast_(model)
    grads = _grads(model, tokens, autocast=autocast)
    assert all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads.values())
    for name in ("blocks.0.attn.wq.weight", "blocks.3.mlp.fc2.weight"):
        error = (grads[name] - reference[name]).norm() / reference[name].norm()
        assert 0 < error < 0.25, f"{name}: float8 gradient off the bf16 one by {error:.1%}"


def test_importing_torchao_keeps_the_cpu_builds_kernel_noise_out() -> None:
    """torchao warns ``Failed to load ... .so`` for each CUDA kernel library it cannot load on
    a CPU build, and pytree about an Enum it registers: neither reaches the console, and the
    loggers' levels are put back afterwards."""
    code = ("import logging\n"
            "from meshmorph.run.model.float8 import torchao_float8\n"
            "torchao_float8()\n"
            "print(logging.getLogger('torchao').level, "
            "logging.getLogger('torch.utils._pytree').level)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "Failed to load" not in out.stderr and "register_constant" not in out.stderr, out.stderr
    assert out.stdout.split() == ["0", "0"]  # NOTSET again: nothing else is silenced
