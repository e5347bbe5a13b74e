"""A model factory meshmorph can trace: ``meshmorph plan --model examples/models/tiny_mlp.py:build``.

Any function callable with no arguments that returns an ``nn.Module`` taking token ids
``LongTensor[batch, seq]`` will do. meshmorph calls it under ``torch.device("meta")``, so even a
factory for a model far larger than this machine's memory is traced without allocating it.
"""

from __future__ import annotations

from torch import nn


class ResidualMLP(nn.Module):
    """x + W2 gelu(W1 x): the block this example repeats."""

    def __init__(self, width: int, expansion: int = 4) -> None:
        super().__init__()
        self.up = nn.Linear(width, expansion * width)
        self.act = nn.GELU()
        self.down = nn.Linear(expansion * width, width)

    def forward(self, x):
        return x + self.down(self.act(self.up(x)))


class TinyMLP(nn.Module):
    """Token embedding, a stack of residual MLP blocks, and a linear head over the vocabulary."""

    def __init__(self, vocab_size: int = 256, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.blocks = nn.ModuleList(ResidualMLP(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab_size, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(vocab_size: int = 256, width: int = 64, depth: int = 4) -> TinyMLP:
    """The factory meshmorph calls (with no arguments: the defaults set the size)."""
    return TinyMLP(vocab_size, width, depth)
