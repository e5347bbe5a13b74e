"""Per-layer activation recompute, applied without renaming any parameter.

``full`` checkpoints a whole transformer block (only its input is kept; the block is run again in
backward); ``selective`` checkpoints only the attention core (scores, softmax and the weighted
sum), which is what Korthikanti et al. 2022 recompute. Both use non-reentrant
``torch.utils.checkpoint`` by replacing the module's ``forward`` on the instance, so hooks that
tensor and data parallelism register on the module keep running outside the checkpoint and the
parameter names (and hence checkpoints) stay those of the plain model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from meshmorph.run.model.decoder import Transformer
from meshmorph.spec.model import Recompute


def checkpoint_module(module: nn.Module) -> None:
    """Make ``module`` keep only its inputs and recompute its forward in backward."""
    inner: Callable[..., Any] = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward  # type: ignore[method-assign]


def apply_recompute(chunk: Transformer, start: int, modes: tuple[Recompute, ...]) -> None:
    """Apply the StagePlan's recompute modes; ``modes[i]`` belongs to layer ``start + i``."""
    for offset, mode in enumerate(modes):
        key = str(start + offset - 1)  # layer i >= 1 is blocks[str(i - 1)]
        if mode == Recompute.NONE or key not in chunk.blocks:
            continue  # embedding and head only support "none" (Plan.check_against refuses others)
        block = chunk.blocks[key]
        if mode == Recompute.FULL:
            checkpoint_module(block)
        elif mode == Recompute.SELECTIVE:
            checkpoint_module(block.attn.core)
