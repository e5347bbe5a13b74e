"""Training configuration shared by the trainer and the job file (``job.toml``)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimConfig:
    """AdamW with linear warm-up and cosine decay, and gradient clipping."""

    lr: float = 3e-3
    """Peak learning rate."""
    min_lr: float | None = None
    """Learning rate at the end of the cosine decay; None (the default): lr / 10."""
    warmup_steps: int = 10
    """Steps of linear warm-up from 0 to ``lr``."""
    decay_steps: int = 1000
    """Steps from the start of training to the end of the cosine decay."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables clipping)."""

    def __post_init__(self) -> None:
        if self.min_lr is None:  # a tenth of the peak, whatever the peak is
            object.__setattr__(self, "min_lr", float(f"{self.lr / 10:.12g}")  # 3e-3 -> 3e-4
                               if isinstance(self.lr, float | int) else self.lr)
        for name in ("lr", "min_lr", "weight_decay", "beta1", "beta2", "eps", "grad_clip"):
            value = getattr(self, name)
            if not math.isfinite(value):
                raise ValueError(f"[optim] {name} must be a finite number, got {value}")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"[optim] needs 0 <= min_lr <= lr and lr > 0, got lr {self.lr}, "
                             f"min_lr {self.min_lr}; set min_lr at most lr, or leave it out "
                             f"(lr / 10)")
        if self.warmup_steps < 0 or self.decay_steps < 1:
            raise ValueError(f"[optim] warmup_steps must be >= 0 and decay_steps >= 1, got "
                             f"{self.warmup_steps} and {self.decay_steps}")
        if self.grad_clip < 0:
            raise ValueError(f"[optim] grad_clip must be >= 0 (0 disables clipping), got "
                             f"{self.grad_clip}")
        if self.weight_decay < 0:
            raise ValueError(f"[optim] weight_decay must be >= 0, got {self.weight_decay}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"[optim] {name} must lie in [0, 1), got {getattr(self, name)}")
        if self.eps <= 0:
            raise ValueError(f"[optim] eps must be positive, got {self.eps}")

    def lr_at(self, step: int) -> float:
        """Learning rate for 0-based ``step`` (warm-up, then cosine to min_lr, then flat)."""
        if self.warmup_steps and step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.decay_steps - self.warmup_steps))
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * progress))
