"""What meshmorph's decoder keeps for backward, eager and compiled, against the cost model
(``LayerSpec.runtime``, ``head_loss_bytes``), measured on the CPU with bf16 autocast, and the
Plan's ``compile`` switch as the cost model prices it."""

from __future__ import annotations

import pytest
import torch

from meshmorph.cost.model import CostModel
from meshmorph.cost.rank_terms import LOSS_BLOCK_BYTES, head_loss_bytes
from meshmorph.run.model.decoder import Block
from meshmorph.run.model.loss import CHUNK_FP32_BYTES
from meshmorph.run.model.saved import saved_tensors
from meshmorph.spec import load_model
from meshmorph.spec.cluster import parse_cluster
from meshmorph.spec.model import Recompute
from meshmorph.spec.plan import Plan


def test_the_cost_models_loss_block_is_the_runtimes() -> None:
    assert LOSS_BLOCK_BYTES == CHUNK_FP32_BYTES


def test_an_eager_gpt_block_under_autocast_keeps_what_the_cost_model_says() -> None:
    # b 2 x s 64 tokens of h 64: shapes unlike any weight (so no activation is mistaken for one)
    spec = load_model("gpt-tiny", 64)
    torch.manual_seed(0)
    block = Block(spec)
    x = torch.randn(3, 64, spec.hidden_size, requires_grad=True)  # fp32: the residual stream
    measured = sum(nbytes for _, _, nbytes in saved_tensors(block, x, torch.bfloat16)[0])
    plan = Plan(model="gpt-tiny", seq_len=64, global_batch=3, micro_batch=3)
    coster = CostModel(spec, parse_cluster("a100-80g:1x1")).coster(plan)
    gpu = CostModel(spec, parse_cluster("a100-80g:1x1")).default_gpu()
    predicted = coster.layer(1, gpu, 3, 1, False, Recompute.NONE).activation_bytes
    # the per-head fp32 log-sum-exp and the norms' per-token statistics are left out (1.2% at h 64)
    assert predicted == pytest.approx(measured, rel=0.02)
    fused = CostModel(spec, parse_cluster("a100-80g:1x1")).layer_coster("bf16").layer(
        1, gpu, 3, 1, False, Recompute.NONE).activation_bytes
    h, tokens = spec.hidden_size, 3 * 64
    # two fp32 norm inputs (+2 bytes each) and k's and v's own bf16 copies of the norm output
    assert predicted - fused == pytest.approx((2 * 2 + 2 * 2) * h * tokens)


def test_compile_keeps_fewer_activations_and_prices_fused_kernels() -> None:
    spec = load_model("llama3.2-1b", 2048)
    cost = CostModel(spec, parse_cluster("h200:1x1"))
    eager = Plan(model="llama3.2-1b", seq_len=2048, global_batch=8, micro_batch=4,
                 num_microbatches=2).with_even_stages(spec)
    compiled = Plan.from_dict({**eager.to_dict(), "compile": True})
    e, c = cost.estimate(eager), cost.estimate(compiled)
    assert c.step_time_s < e.step_time_s
    assert max(c.peak_memory_gib) < max(e.peak_memory_gib)
    gpu, h, f = cost.default_gpu(), spec.hidden_size, spec.ffn_hidden_size
    layer = {p: cost.coster(p).layer(1, gpu, 4, 1, False, Recompute.NONE) for p in (eager, compiled)}
    # eager: two fp32 norm inputs and three more bf16 copies of norm outputs (k, v, w3);
    # compiled: the block's fp32 input, and SwiGLU's silu(gate) recomputed, not kept
    tokens = 4 * 2048
    assert layer[eager].activation_bytes - layer[compiled].activation_bytes == pytest.approx(
        ((2 * 2 + 3 * 2 - 2) * h + 2 * f) * tokens)


def test_the_whole_logits_loss_holds_the_product_and_one_row_block() -> None:
    spec = load_model("llama3.2-1b", 2048)
    cost = CostModel(spec, parse_cluster("h200:1x1"))
    plan = Plan(model="llama3.2-1b", seq_len=2048, global_batch=8, micro_batch=8)
    assert head_loss_bytes(cost, plan, 0) == 2 * spec.padded_vocab_size * 8 * 2048 \
        + 2 * LOSS_BLOCK_BYTES


def test_another_frameworks_loss_over_a_fp32_copy_keeps_eight_bytes_per_logit() -> None:
    from meshmorph.spec.transformer import TransformerShape, build_transformer

    shape = TransformerShape(name="tt", arch="llama", num_layers=2, hidden_size=256,
                             num_heads=4, vocab_size=32000, seq_len=512, runtime=False)
    model = build_transformer(shape)
    cost = CostModel(model, parse_cluster("h100:1x1"))
    plan = Plan(model="tt", seq_len=512, global_batch=2, micro_batch=2)
    assert model.layers[1].runtime is None
    assert head_loss_bytes(cost, plan, 0) == 8 * model.padded_vocab_size * 2 * 512
