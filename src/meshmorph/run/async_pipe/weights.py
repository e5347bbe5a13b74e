"""The weights a stage's forward computes with, by mode (see ``run/async_pipe/executor.py``).

``WeightSource.for_forward`` returns one leaf tensor per parameter; the forward runs through
them (``torch.func.functional_call``) and the backward leaves its weight gradients on them:

- ``alias``: views of the parameters' storage through ``param.data``, which has its own version
  counter, so the optimizer may update the parameters before the backward and the backward then
  computes with the updated values (stale, unstashed; also the synchronous case, where no update
  happens inside a step);
- ``stash``: a copy taken now (the backward uses exactly these values);
- ``2bw``: one copy per weight version, shared by the forwards of that version;
- ``sgd`` / ``adam``: the weights predicted ``steps`` updates ahead (``prediction.predict``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from meshmorph.run.async_pipe.prediction import predict

MODES = ("alias", "stash", "2bw", "sgd", "adam")
"""What ``for_forward`` accepts."""


class WeightSource:
    """Hands out the forward's weights of one stage and counts its weight versions."""

    def __init__(self, params: list[torch.Tensor], optimizer: torch.optim.Optimizer, *,
                 lr_at: Callable[[int], float] | None = None) -> None:
        self.params, self.optimizer = params, optimizer
        self.lr_at = lr_at
        """The learning rate of update number ``version`` (None: the optimizer's own)."""
        self.version = 0
        """Optimizer steps taken so far."""
        self._snapshot: tuple[int, list[torch.Tensor]] | None = None

    def for_forward(self, mode: str, steps: int = 0) -> list[torch.Tensor]:
        """Leaf tensors (requires_grad) standing for the parameters in a forward."""
        if mode == "alias":
            return [p.data.requires_grad_() for p in self.params]
        if mode == "stash":
            return [p.detach().clone().requires_grad_() for p in self.params]
        if mode == "2bw":
            if self._snapshot is None or self._snapshot[0] != self.version:
                self._snapshot = (self.version, [p.detach().clone().requires_grad_()
                                                 for p in self.params])
            return self._snapshot[1]
        if mode in ("sgd", "adam"):
            return [t.requires_grad_() for t in predict(self.params, self.optimizer, mode, steps)]
        raise ValueError(f"weight mode must be one of {', '.join(MODES)}, got {mode!r}")

    def step(self) -> None:
        """Apply the accumulated gradient (one optimizer step) and clear it."""
        if self.lr_at is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = self.lr_at(self.version)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)
        self.version += 1

    def add_grads(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """Move the weight gradients a backward left on ``leaves`` into the parameters' ``.grad``
        (accumulating); returns them (zeros where a leaf got none)."""
        grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]
        for param, grad, leaf in zip(self.params, grads, leaves, strict=True):
            if param.grad is None:
                param.grad = grad.detach().clone()
            else:
                param.grad.add_(grad)
            leaf.grad = None
        return grads
