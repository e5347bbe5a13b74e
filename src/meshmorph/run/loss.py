"""The training loss: mean token cross-entropy."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every token of a micro-batch: logits [b, s, V], labels [b, s].

    All micro-batches hold the same number of tokens, so the mean of micro-batch means (over
    micro-batches and data-parallel ranks) is the mean over the global batch."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
