"""On a CUDA device: the reference GPT trains a step in bf16 autocast with a finite loss.

Skipped where CUDA is absent (the CPU test suite covers the same model over gloo).
"""

from __future__ import annotations

import math

import pytest
import torch

from meshmorph.run.model.decoder import build_model
from meshmorph.run.model.loss import token_cross_entropy
from meshmorph.spec.catalog import catalog_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.timeout(120)
def test_gpt_tiny_bf16_autocast_forward_backward_gives_finite_loss_and_grads() -> None:
    spec = catalog_model("gpt-tiny", seq_len=32)
    device = torch.device("cuda")
    model = build_model(spec, seed=0).to(device)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab_size, (4, spec.seq_len + 1), generator=generator)
    tokens = tokens.to(device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
        logits = model(inputs)
        loss = token_cross_entropy(logits, labels)
    loss.backward()
    torch.cuda.synchronize()

    assert logits.dtype == torch.bfloat16
    assert logits.shape == (4, spec.seq_len, spec.vocab_size)
    value = loss.item()
    assert math.isfinite(value)
    # freshly initialised weights (std 0.02) give near-uniform predictions: loss ~ ln(V)
    assert abs(value - math.log(spec.vocab_size)) < 0.5
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and g.device.type == "cuda" for g in grads)
    assert all(torch.isfinite(g).all().item() for g in grads)
    assert sum(g.abs().sum().item() for g in grads) > 0.0
