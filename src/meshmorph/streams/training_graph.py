"""The whole training step (forward and backward) as one aten-level fx graph.

AOT autograd (``aot_export_module(..., trace_joint=True)``, the joint-graph export that
``torch.export`` builds on) traces forward and backward of ``loss = mean(module(x) ** 2)`` into a
functional graph of aten operators: no in-place operators, batch-norm statistic updates returned as
outputs, and each gradient of a tensor read by several operators summed by explicit ``add`` nodes
in a fixed order. Its inputs are the parameters, then the buffers, then the user's inputs; its
outputs the updated buffers, the loss, then one gradient per parameter. The stand-in loss only sets
the output gradient; the shape of the backward graph does not depend on it.

The export lives under ``torch._functorch`` (private): this file is the one place that calls it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx


class _MeanSquareLoss(torch.nn.Module):
    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.module(*inputs).float().square().mean(),)


@dataclass(frozen=True, slots=True)
class TrainingStepGraph:
    """A joint forward-backward graph and how to call it."""

    module: torch.fx.GraphModule
    """Aten-level graph: (*parameters, *buffers, *inputs) -> (*new buffers, loss, *gradients)."""
    parameter_names: tuple[str, ...]
    """Qualified names of the parameters, in the order the graph takes them and returns grads."""
    buffer_names: tuple[str, ...]
    """Qualified names of the buffers the graph reads, in order."""
    mutated_buffers: int
    """How many leading outputs are updated buffers (batch-norm running statistics)."""


def trace_training_step(module: torch.nn.Module,
                        inputs: tuple[torch.Tensor, ...]) -> TrainingStepGraph:
    """Export forward + backward of the mean-square stand-in loss of ``module`` on ``inputs``."""
    from torch._functorch.aot_autograd import aot_export_module

    if not any(p.requires_grad for p in module.parameters()):
        raise ValueError(f"{type(module).__name__} has no trainable parameters; a training-step "
                         "graph needs at least one (or drop --training)")
    try:
        gm, signature = aot_export_module(_MeanSquareLoss(module), list(inputs),
                                          trace_joint=True, output_loss_index=0)
    except Exception as exc:  # the export refuses data-dependent control flow and the like
        raise ValueError(f"cannot export the training step of {type(module).__name__} ({exc}); "
                         "use the forward graph instead (drop --training)") from None
    strip = len("module.")
    return TrainingStepGraph(
        module=gm,
        parameter_names=tuple(name[strip:] for name in signature.parameters),
        buffer_names=tuple(name[strip:] for name in signature.buffers),
        mutated_buffers=len(signature.buffers_to_mutate))


def leading_inputs(step: TrainingStepGraph, module: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    """The module's live parameters and buffers in the order the graph takes them."""
    params = dict(module.named_parameters())
    buffers = dict(module.named_buffers())
    return (*(params[n] for n in step.parameter_names), *(buffers[n] for n in step.buffer_names))
