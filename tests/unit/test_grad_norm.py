"""The gradient norm of one process and clipping: float64 sums, torch's clip rule."""

from __future__ import annotations

import torch

from meshmorph.run.engine.grad_norm import (
    CLASSES,
    clip_grads_,
    global_grad_norm,
    local_sums_of_squares,
    placement_class,
)


def _grads() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(37, 5, generator=gen), torch.randn(11, generator=gen) * 1e3,
            torch.randn(2, 3, 4, generator=gen) * 1e-4]


def test_one_process_norm_equals_the_float64_norm_of_all_elements() -> None:
    grads = _grads()
    exact = float(torch.cat([g.double().flatten() for g in grads]).norm())
    assert abs(global_grad_norm(grads, None) - exact) <= 1e-12 * exact


def test_plain_gradients_fall_in_the_replicated_class_only() -> None:
    grads = _grads()
    sums, present = local_sums_of_squares(grads)
    assert placement_class(grads[0]) == () and present == {CLASSES.index(())}
    assert sums.dtype == torch.float64 and sums.shape == (4,)
    assert float(sums[1:].abs().sum()) == 0.0
    expected = sum(float(g.double().square().sum()) for g in grads)
    assert abs(float(sums[0]) - expected) <= 1e-12 * expected


def test_clipping_follows_torch_clip_grad_norm() -> None:
    ours = _grads()
    theirs = [torch.nn.Parameter(torch.zeros_like(g)) for g in ours]
    for param, grad in zip(theirs, ours, strict=True):
        param.grad = grad.clone()
    torch.nn.utils.clip_grad_norm_(theirs, max_norm=0.5)
    clip_grads_(ours, global_grad_norm(ours, None), 0.5)
    for grad, param in zip(ours, theirs, strict=True):
        torch.testing.assert_close(grad, param.grad, rtol=1e-6, atol=0)
    assert abs(global_grad_norm(ours, None) - 0.5) < 1e-6


def test_clipping_leaves_a_small_gradient_alone() -> None:
    grads = [torch.full((3,), 0.1)]
    clip_grads_(grads, global_grad_norm(grads, None), 1.0)
    assert torch.equal(grads[0], torch.full((3,), 0.1))
