"""Training configuration shared by the trainer and the job file (``job.toml``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_LR = 10.0
"""The highest peak learning rate a job takes: AdamW's peak rates lie far below it (about 1e-4
to 1e-2); a higher one is a typo that would train to NaN or noise."""
MAX_STEPS = 10**9
"""The most steps a job (``[train] steps``, ``[optim] warmup_steps`` and ``decay_steps``) takes:
a billion optimizer steps, hundreds of times the longest published runs (a few million)."""


def check_steps(key: str, value: int) -> None:
    """Refuse a step count above ``MAX_STEPS`` (a typo: a run that would never end)."""
    if value > MAX_STEPS:
        raise ValueError(f"{key} = {_shown(value)} is above {MAX_STEPS:,}, hundreds of times the "
                         "longest published training runs (a few million steps); give the "
                         "number of optimizer steps")


def _shown(value: float) -> str:
    """A figure as a user would have typed it: ``1e10``, ``0.001``, ``10,000,000``."""
    return f"{value:,}" if isinstance(value, int) else f"{value:g}".replace("e+", "e")


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
        if self.lr > MAX_LR:
            raise ValueError(f"[optim] lr = {_shown(self.lr)} is above {MAX_LR:g}, a rate no "
                             "model trains at (AdamW's peak rates lie about 1e-4 to 1e-2); give "
                             "the peak learning rate, e.g. lr = 3e-4")
        if self.warmup_steps < 0 or self.decay_steps < 1:
            raise ValueError(f"[optim] warmup_steps must be >= 0 and decay_steps >= 1, got "
                             f"{self.warmup_steps} and {self.decay_steps}")
        for name in ("warmup_steps", "decay_steps"):
            check_steps(f"[optim] {name}", getattr(self, name))
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
