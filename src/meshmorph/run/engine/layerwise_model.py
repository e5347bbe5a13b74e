"""The forward of a layerwise chunk: each layer on its own block of the micro-batch, activations
moved between layers whose tp degrees differ.

A stage micro-batch holds B = plan dp x micro_batch sequences. Under a layout (tp, dp) a rank
runs the B / dp sequences of its data-parallel block (rank // tp, stage-local), replicated on
its tp ranks. The runner takes this rank's micro-batch share as the trainer cuts it (the plan's
own (tp, dp) layout), moves the tokens to the first layer's layout, runs every layer, moving the
hidden state between neighbours whose tp differs (run/parallel/layerwise_redistribute.py: a local slice
or an all-gather of the batch dim, and the reverse in backward), and hands back the last
layer's logits with the labels moved to the same layout. A pipeline stage (pp > 1) instead
ends in the data layout, the one every stage's input comes in: torch pipelining sends each
rank's output to the rank of the same (dp, tp) coordinate on the next stage, which receives
it in the stage's base layout, and sends the gradient back the same way.

With sequence parallelism the hidden state between layers is also split along the sequence
over each layer's tp ranks (a tp 1 layer holds whole sequences; the embedding's output comes
out so, run/parallel/layerwise_parallelize.py), and moves between layouts by
``redistribute_sequence``'s all-to-all; a pipeline stage hands it over in the data layout's
sequence split, as the uniform pipeline does. Token ids, logits and labels hold whole
sequences and move as without it.
"""

from __future__ import annotations

import torch
from torch import nn

from meshmorph.run.parallel.layerwise_parallelize import LayerLayouts, LayerUnit
from meshmorph.run.parallel.layerwise_redistribute import redistribute, redistribute_sequence


class LayerwiseRunner(nn.Module):
    """Runs the layers of one layerwise chunk (module docstring); holds the chunk so its
    parameters keep the plain model's names."""

    def __init__(self, chunk: nn.Module, units: list[LayerUnit], layouts: LayerLayouts,
                 data_tp: int, *, boundary_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.chunk = chunk
        self.units = units
        self.layouts = layouts
        self.data_tp = data_tp
        """tp degree of the layout the trainer cuts the batch in (the plan's tp)."""
        self.boundary_dtype = boundary_dtype
        """A pipeline stage's output dtype (the one torch pipelining's receiver expects); the
        output then also moves back to the data layout, in which pipeline stages hand over
        activations. None without a pipeline: the logits stay in the last layer's layout."""
        self.sequence_parallel = any(unit.sequence_parallel for unit in units)
        """Whether the hidden state is split along the sequence over each layer's tp ranks."""

    @property
    def out_tp(self) -> int:
        """tp degree of the layout the output comes out in: the last layer's, or the data
        layout's at a pipeline stage boundary."""
        return self.data_tp if self.boundary_dtype is not None else self.units[-1].strategy.tp

    def labels(self, labels: torch.Tensor) -> torch.Tensor:
        """This rank's labels moved from the data layout to the logits' layout."""
        with torch.no_grad():
            return redistribute(labels, self.data_tp, self.out_tp, self.layouts.groups)

    def _move(self, x: torch.Tensor, tp_a: int, tp_b: int, hidden: bool) -> torch.Tensor:
        if not x.is_floating_point():
            with torch.no_grad():  # token ids carry no gradient
                return redistribute(x, tp_a, tp_b, self.layouts.groups)
        if hidden and self.sequence_parallel:
            return redistribute_sequence(x, tp_a, tp_b, self.layouts.groups)
        return redistribute(x, tp_a, tp_b, self.layouts.groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tp = self.data_tp
        hidden = x.is_floating_point()  # a later pipeline stage's input: the hidden state
        head = getattr(self.chunk, "head", None)
        for unit in self.units:
            if unit.strategy.tp != tp:
                x = self._move(x, tp, unit.strategy.tp, hidden)
                tp = unit.strategy.tp
            x = unit.module(x)
            hidden = head is None or unit.module is not head  # after the head: logits
        if self.boundary_dtype is not None:  # a pipeline stage's output, in the data layout
            x = self._move(x.to(self.boundary_dtype), tp, self.data_tp, hidden)
        return x
