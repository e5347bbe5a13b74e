"""Training configuration shared by the trainer and the job file (``job.toml``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimConfig:
    """AdamW with linear warm-up and cosine decay, and gradient clipping."""

    lr: float = 3e-3
    """Peak learning rate."""
    min_lr: float = 3e-4
    """Learning rate at the end of the cosine decay."""
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
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"need 0 <= min_lr <= lr and lr > 0, got lr {self.lr}, min_lr {self.min_lr}")
        if self.warmup_steps < 0 or self.decay_steps < 1:
            raise ValueError("warmup_steps must be >= 0 and decay_steps >= 1")

    def lr_at(self, step: int) -> float:
        """Learning rate for 0-based ``step`` (warm-up, then cosine to min_lr, then flat)."""
        import math

        if self.warmup_steps and step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.decay_steps - self.warmup_steps))
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * progress))
