"""A model chunk as segments: runs of consecutive layers that share a strategy (tp, dp, ZeRO),
each parallelized once on its own split of the stage's devices (run/parallel/parallelize.py).

A plan without per-layer strategies gives every chunk one segment on the plan's mesh, run as a
whole by torch's wrappers (DDP or ``replicate``, FSDP2 per block plus the chunk root). A plan
that lists them runs each layer's data parallelism on its own (``Segment.per_layer``: one
FSDP2 unit per layer, one summed all-reduce per ZeRO 0/1 segment after the backward), as
cost/rank_state.py prices it, and its chunks run through ``SegmentRunner``, which moves the
activation between neighbouring segments whose splits differ.

Under a split (tp, dp) a rank runs the B / dp sequences of its data-parallel block (rank // tp,
stage-local) of a stage micro-batch of B = plan dp x micro_batch sequences, replicated on its tp
ranks. ``SegmentRunner`` takes this rank's micro-batch share as the trainer cuts it (the plan's
own (tp, dp) layout), moves the tokens to the first segment's split, runs every segment, moving
the hidden state where the tp degree changes (run/parallel/redistribute.py: a local slice or an
all-gather of the batch dim, and the reverse in backward), and hands back the last segment's
logits with the labels moved to the same split. A pipeline stage (pp > 1) instead ends in the
data layout, the one every stage's input comes in: torch pipelining sends each rank's output to
the rank of the same (dp, tp) coordinate on the next stage, and the gradient back the same way.

With sequence parallelism the hidden state between layers is also split along the sequence over
each segment's tp ranks (a tp 1 segment holds whole sequences) and moves by
``redistribute_sequence``'s all-to-all; a pipeline stage hands it over in the data layout's
sequence split, as the uniform pipeline does. Token ids, logits and labels hold whole sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from meshmorph.run.model.decoder import Transformer
from meshmorph.run.parallel.mesh import SegmentMesh
from meshmorph.run.parallel.redistribute import LayoutGroups, redistribute, redistribute_sequence
from meshmorph.spec.model import ModelSpec
from meshmorph.spec.plan import LayerStrategy, Plan, StagePlan
from meshmorph.spec.runnable import stage_strategies


@dataclass(slots=True, kw_only=True)
class Segment:
    """Consecutive layers of one chunk under one strategy, parallelized on one split."""

    start: int
    """Its first layer (index in ``ModelSpec.layers``)."""
    stop: int
    """One past its last layer."""
    strategy: LayerStrategy
    """Its tp / dp / ZeRO."""
    mesh: SegmentMesh
    """The split of the stage's devices it runs on."""
    per_layer: bool
    """Whether its data parallelism runs layer by layer with gradients summed over the dp
    group (a plan whose layers' strategies differ); False: the chunk as a whole, gradients
    averaged by torch's wrappers (a uniform plan)."""
    names: list[str]
    """Its layers' module names in the chunk (``embed``, ``blocks.<i>``, ``head``), in order."""
    modules: list[nn.Module]
    """Its layers' modules, in order."""
    params: list[nn.Parameter] = field(default_factory=list)
    """The parameters it owns, as registered after parallelizing (a tied head's weight belongs
    to the embedding's segment)."""
    fsdp_units: list[nn.Module] = field(default_factory=list)
    """The FSDP2 units sharding it: its layers (per layer), or the chunk's blocks and root."""

    @property
    def fsdp(self) -> bool:
        """Whether FSDP2 shards it (ZeRO 2/3 over more than one rank)."""
        return self.strategy.dp > 1 and self.strategy.zero >= 2

    @property
    def reduced_after_backward(self) -> bool:
        """Whether the engine all-reduces its gradients after the backward (ZeRO 0/1 over more
        than one rank, layer by layer)."""
        return self.per_layer and self.strategy.dp > 1 and self.strategy.zero <= 1


def layer_module(chunk: Transformer, spec: ModelSpec, index: int) -> tuple[str, nn.Module]:
    """The name and module of layer ``index`` (of ``ModelSpec.layers``) in ``chunk``."""
    if index == 0:
        assert chunk.embed is not None
        return "embed", chunk.embed
    if index == spec.num_layers - 1:
        assert chunk.head is not None
        return "head", chunk.head
    return f"blocks.{index - 1}", chunk.blocks[str(index - 1)]


def strategy_runs(plan: Plan, stage: StagePlan) -> list[tuple[int, int, LayerStrategy]]:
    """(start, stop, strategy) of each run of consecutive layers of ``stage`` that share a
    strategy: one run per stage of a uniform plan."""
    runs: list[tuple[int, int, LayerStrategy]] = []
    for offset, strategy in enumerate(stage_strategies(plan, stage)):
        index = stage.start + offset
        if runs and runs[-1][2] == strategy:
            runs[-1] = (runs[-1][0], index + 1, strategy)
        else:
            runs.append((index, index + 1, strategy))
    return runs


class SegmentRunner(nn.Module):
    """Runs a chunk whose segments lie on different splits (module docstring); holds the chunk
    so its parameters keep the plain model's names."""

    def __init__(self, chunk: Transformer, segments: list[Segment], moves: LayoutGroups | None,
                 *, data_tp: int, sequence_parallel: bool,
                 boundary_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.chunk = chunk
        self.segments = segments
        self.moves = moves
        """The groups that move activations between splits (None: every split is one tp)."""
        self.data_tp = data_tp
        """tp degree of the layout the trainer cuts the batch in (the plan's tp)."""
        self.sequence_parallel = sequence_parallel
        """Whether the hidden state is split along the sequence over each segment's tp ranks."""
        self.boundary_dtype = boundary_dtype
        """A pipeline stage's output dtype (the one torch pipelining's receiver expects); the
        output then also moves back to the data layout, in which pipeline stages hand over
        activations. None without a pipeline: the logits stay in the last segment's split."""

    @property
    def out_tp(self) -> int:
        """tp degree of the split the output comes out in: the last segment's, or the data
        layout's at a pipeline stage boundary."""
        return self.data_tp if self.boundary_dtype is not None else self.segments[-1].strategy.tp

    def labels(self, labels: torch.Tensor) -> torch.Tensor:
        """This rank's labels moved from the data layout to the logits' split."""
        with torch.no_grad():
            return redistribute(labels, self.data_tp, self.out_tp, self.moves)  # type: ignore[arg-type]

    def _move(self, x: torch.Tensor, tp_a: int, tp_b: int, hidden: bool) -> torch.Tensor:
        if not x.is_floating_point():
            with torch.no_grad():  # token ids carry no gradient
                return redistribute(x, tp_a, tp_b, self.moves)  # type: ignore[arg-type]
        if hidden and self.sequence_parallel:
            return redistribute_sequence(x, tp_a, tp_b, self.moves)  # type: ignore[arg-type]
        return redistribute(x, tp_a, tp_b, self.moves)  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tp = self.data_tp
        hidden = x.is_floating_point()  # a later pipeline stage's input: the hidden state
        for segment in self.segments:
            if segment.strategy.tp != tp:
                x = self._move(x, tp, segment.strategy.tp, hidden)
                tp = segment.strategy.tp
            for name, module in zip(segment.names, segment.modules, strict=True):
                x = module(x)
                hidden = name != "head"  # after the head: logits
        if self.boundary_dtype is not None:  # a pipeline stage's output, in the data layout
            x = self._move(x.to(self.boundary_dtype), tp, self.data_tp, hidden)
        return x


@dataclass(slots=True, kw_only=True)
class ParallelChunk:
    """One model chunk as this rank runs it."""

    index: int
    """Its index in ``Plan.stages``."""
    module: Transformer
    """The chunk itself: the model part, with the plain model's parameter names."""
    runner: nn.Module
    """What runs it: the chunk, its DDP wrapper, or a ``SegmentRunner``."""
    segments: list[Segment]
    """Its segments, in layer order."""

    @property
    def params(self) -> list[nn.Parameter]:
        """Every parameter of the chunk once, as registered now."""
        return [p for segment in self.segments for p in segment.params]

    def labels(self, labels: torch.Tensor) -> torch.Tensor:
        """This rank's labels laid out as the chunk's logits."""
        runner = self.runner
        return runner.labels(labels) if isinstance(runner, SegmentRunner) else labels
