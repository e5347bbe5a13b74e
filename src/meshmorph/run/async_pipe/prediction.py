"""Weight prediction against staleness, and the guard that watches it.

A stage whose forward of micro-batch ``j`` runs ``s`` of its own updates before that micro-batch's
backward (``s`` from the schedule, ``actions.staleness``) computes the forward with the
weights it predicts those ``s`` updates will produce:

- momentum SGD (SpecTrain, Chen et al. 2018): ``W(t+s) = W(t) - s * lr * v(t)``, ``v`` torch's
  momentum buffer (the next update is ``lr * v`` if the gradient does not change; exact once the
  buffer sits at its fixed point ``g / (1 - momentum)`` of a constant gradient ``g``);
- Adam: ``W(t+s) = W(t) - s * lr * m_hat / (sqrt(v_hat) + eps)``, the bias-corrected update
  direction extrapolated over ``s`` steps (exact for a constant gradient from the first step:
  then ``m_hat = g`` and ``v_hat = g^2`` at every step).

``PredictionGuard`` compares, when a micro-batch's backward arrives, the predicted weights with
the weights the stage actually holds then, relative to how far the stale weights were off:
``||W_pred - W_now|| / ||W_fwd - W_now||`` (0: perfect, 1: no better than not predicting).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


def predict_sgd(param: torch.Tensor, state: dict, lr: float, steps: int) -> torch.Tensor:
    """SpecTrain's momentum-SGD prediction of ``param`` ``steps`` updates ahead (a new tensor)."""
    buf = state.get("momentum_buffer")
    if buf is None or steps == 0:
        return param.detach().clone()
    return param.detach() - steps * lr * buf


def predict_adam(param: torch.Tensor, state: dict, lr: float, steps: int,
                 betas: tuple[float, float], eps: float) -> torch.Tensor:
    """Adam's update direction at its current moments, extrapolated ``steps`` updates ahead."""
    if not state or steps == 0:
        return param.detach().clone()
    t = float(state["step"])
    m_hat = state["exp_avg"] / (1 - betas[0] ** t)
    v_hat = state["exp_avg_sq"] / (1 - betas[1] ** t)
    return param.detach() - steps * lr * m_hat / (v_hat.sqrt() + eps)


def predict(params: list[torch.Tensor], optimizer: torch.optim.Optimizer, rule: str,
            steps: int) -> list[torch.Tensor]:
    """The predicted value of each of ``params`` (one optimizer group) under ``rule``."""
    group = optimizer.param_groups[0]
    if rule == "sgd":
        return [predict_sgd(p, optimizer.state[p], group["lr"], steps) for p in params]
    if rule == "adam":
        return [predict_adam(p, optimizer.state[p], group["lr"], steps, group["betas"],
                             group["eps"]) for p in params]
    raise ValueError(f"weight prediction rule must be 'sgd' or 'adam', got {rule!r}")


def distance(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Euclidean distance between two lists of tensors taken as one vector."""
    return math.sqrt(sum(float((x.detach() - y.detach()).double().pow(2).sum())
                         for x, y in zip(a, b, strict=True)))


@dataclass(slots=True, kw_only=True)
class PredictionGuard:
    """Falls back to flushing when the prediction error ratio, averaged over a window of
    backwards, exceeds ``threshold``."""

    threshold: float
    """Largest tolerated mean ratio ``||W_pred - W_now|| / ||W_fwd - W_now||``."""
    window: list[float] = field(default_factory=list)
    """Ratios measured since the last check."""
    history: list[float] = field(default_factory=list)
    """Mean ratio of every check so far."""

    def observe(self, predicted: list[torch.Tensor], forward: list[torch.Tensor],
                now: list[torch.Tensor]) -> float | None:
        """Record one backward's ratio; None (and nothing recorded) when nothing went stale."""
        stale = distance(forward, now)
        if stale == 0.0:
            return None
        ratio = distance(predicted, now) / stale
        self.window.append(ratio)
        return ratio

    def window_mean(self) -> float:
        """Mean ratio since the last check (0 when none was measured); clears the window."""
        mean = sum(self.window) / len(self.window) if self.window else 0.0
        self.window.clear()
        self.history.append(mean)
        return mean

    def trips(self, worst_mean: float) -> bool:
        """Whether the worst stage's window mean calls for flushing."""
        return worst_mean > self.threshold
