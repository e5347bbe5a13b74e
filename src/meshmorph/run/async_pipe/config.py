"""Configuration of the asynchronous pipeline executor (``run/async_pipe/executor.py``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshmorph.spec.plan import WEIGHT_PREDICTIONS


@dataclass(frozen=True, slots=True, kw_only=True)
class AsyncPipelineConfig:
    """One pipeline run: schedule, weight handling, optimizer and guard."""

    synchronous: bool = False
    """True: synchronous 1F1B with a flush per step (the reference the async modes are measured
    against, run by the same executor); False: 1F1B without flush."""
    weight_prediction: str = "none"
    """Asynchronous weights: ``none`` (stale: the forward uses the weights of its time, the
    backward the current ones, PipeDream without stashing), ``stash`` (the backward uses exactly
    the forward's weights), ``2bw`` (PipeDream-2BW: stashing with an update every
    ``num_microbatches`` micro-batches, so at most two versions live), ``sgd`` (SpecTrain's
    momentum-SGD prediction), ``adam`` (Adam's update direction extrapolated)."""
    num_microbatches: int = 4
    """Micro-batches per optimizer step under ``synchronous`` and ``2bw``: each batch is cut into
    this many (the other async modes step once per batch, a batch being one micro-batch)."""
    optimizer: str = "sgd"
    """``sgd`` (momentum SGD), ``adam`` or ``adamw`` (``meshmorph run``'s optimizer); ``sgd``
    prediction needs ``sgd``, ``adam`` prediction ``adam`` or ``adamw`` (the decoupled weight
    decay is not extrapolated)."""
    weight_decay: float = 0.0
    """Decoupled weight decay of ``adamw``."""
    lr: float = 0.05
    """Constant learning rate."""
    momentum: float = 0.9
    """Momentum of SGD."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam's betas."""
    eps: float = 1e-8
    """Adam's epsilon."""
    guard_threshold: float | None = 1.0
    """Fall back to flushing when the worst stage's mean prediction error ratio over a window
    (``||W_pred - W_now|| / ||W_fwd - W_now||``; 1 = no better than stale) exceeds this; None
    turns the guard off. Only with ``sgd`` / ``adam`` prediction."""
    guard_every: int = 16
    """Micro-batches per guard window (the stages agree on the ratio once per window)."""
    record_grads: int = 0
    """Keep a copy of the gradient of the first this many backwards of each stage (tests)."""

    def __post_init__(self) -> None:
        if self.weight_prediction not in WEIGHT_PREDICTIONS:
            raise ValueError(f"weight_prediction must be one of {', '.join(WEIGHT_PREDICTIONS)}, "
                             f"got {self.weight_prediction!r}")
        if self.optimizer not in ("sgd", "adam", "adamw"):
            raise ValueError(f"optimizer must be 'sgd', 'adam' or 'adamw', got {self.optimizer!r}")
        if self.weight_prediction in ("sgd", "adam") and \
                self.optimizer.rstrip("w") != self.weight_prediction:
            raise ValueError(f"weight_prediction {self.weight_prediction!r} predicts the "
                             f"{self.weight_prediction} update but the optimizer is "
                             f"{self.optimizer!r}; use optimizer {self.weight_prediction!r}")
        if self.weight_prediction == "sgd" and not 0 < self.momentum < 1:
            raise ValueError(f"sgd weight prediction extrapolates the momentum buffer: momentum "
                             f"must lie in (0, 1), got {self.momentum}")
        if self.num_microbatches < 1 or self.guard_every < 1:
            raise ValueError("num_microbatches and guard_every must be at least 1")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a positive number, got {self.lr}")
        if self.guard_threshold is not None and not self.guard_threshold >= 0:
            raise ValueError(f"guard_threshold must be >= 0 or None, got {self.guard_threshold}")

    @property
    def predicts(self) -> bool:
        """Whether forwards use predicted weights."""
        return not self.synchronous and self.weight_prediction in ("sgd", "adam")

    @property
    def per_batch(self) -> int:
        """Micro-batches each batch is cut into."""
        if self.synchronous or self.weight_prediction == "2bw":
            return self.num_microbatches
        return 1
