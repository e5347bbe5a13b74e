"""The fp16 loss scale: halved and the step skipped on an overflow, doubled after good steps."""

from __future__ import annotations

import math

import torch

from meshmorph.run.engine.loss_scale import LossScaler


def test_an_infinite_norm_skips_the_step_and_halves_the_scale() -> None:
    scaler = LossScaler(scale=1024.0, growth_interval=3)
    assert scaler.update(math.inf) is False
    assert scaler.update(math.nan) is False
    assert (scaler.scale, scaler.skipped_steps, scaler.good_steps) == (256.0, 2, 0)


def test_the_scale_doubles_after_growth_interval_finite_steps_in_a_row() -> None:
    scaler = LossScaler(scale=8.0, growth_interval=3)
    assert [scaler.update(1.0) for _ in range(3)] == [True, True, True]
    assert scaler.scale == 16.0
    scaler.update(math.inf)  # an overflow restarts the count
    assert [scaler.update(1.0) for _ in range(2)] == [True, True]
    assert scaler.scale == 8.0


def test_unscale_divides_every_gradient_by_the_scale() -> None:
    grads = [torch.full((3,), 6.0), torch.full((2, 2), -3.0)]
    LossScaler(scale=3.0).unscale_(grads)
    assert grads[0].tolist() == [2.0, 2.0, 2.0]
    assert grads[1].tolist() == [[-1.0, -1.0], [-1.0, -1.0]]
