"""Dynamic loss scaling for fp16 plans (the rule of ``torch.amp.GradScaler``, on the global norm).

The loss is multiplied by ``scale`` before backward, so small fp16 gradients do not flush to
zero; gradients are divided by it again before clipping and the optimizer step. When the global
gradient norm (one collective over every rank, so all ranks agree) is not finite, the step is
skipped and the scale halved; after ``growth_interval`` good steps in a row it doubles.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class LossScaler:
    """The fp16 loss scale and its growth/backoff rule."""

    scale: float = 2.0**16
    """Current multiplier of the loss."""
    growth_interval: int = 2000
    """Finite steps in a row after which the scale doubles."""
    good_steps: int = 0
    """Finite steps since the last change of scale."""
    skipped_steps: int = 0
    """Steps skipped because the gradient overflowed."""

    def unscale_(self, grads: Iterable[torch.Tensor]) -> None:
        """Divide every gradient by the scale, in place."""
        for grad in grads:
            grad.mul_(1.0 / self.scale)

    def update(self, grad_norm: float) -> bool:
        """Whether to take the optimizer step, given the unscaled global gradient norm; halves
        the scale on an overflow, doubles it after ``growth_interval`` good steps."""
        if not math.isfinite(grad_norm):
            self.scale /= 2.0
            self.good_steps = 0
            self.skipped_steps += 1
            return False
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0:
            self.scale *= 2.0
        return True
