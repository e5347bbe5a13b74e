"""Small multi-branch image nets for stream assignment: a name -> factory catalog.

``inception-stack`` (Inception-style blocks: 1x1, 1x1->3x3, 1x1->5x5 and pool->1x1 branches
concatenated), ``nasnet-stack`` (NASNet-style cells: five pairwise-combined branches over the two
previous cell outputs) and ``resnet-stack`` (ResNet-style basic blocks, a projection shortcut where
the shape changes). Each module carries ``example_input_shape`` (one sample, no batch dimension);
a user factory ``package.module:function`` may set the same attribute or the CLI's
``--input-shape`` gives it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

MAX_INPUT_VALUES = 2**24
"""The most input values (batch x sample shape) a net is traced with on this CPU."""


CHANNELS, BLOCKS, IMAGE_SIZE, CLASSES = 16, 3, 32, 10
"""Size of every catalog net, small enough that CPU tests run in seconds: channels of the stem and
of every block's output (divisible by 4: the Inception branches split them four ways), blocks
(or cells) after the stem, height and width of the input image, outputs of the head."""


def _conv(cin: int, cout: int, k: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, k, padding=k // 2, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU())


class InceptionBlock(nn.Module):
    """Four parallel branches over one input, concatenated along channels."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        c = cout // 4
        self.b1 = _conv(cin, c, 1)
        self.b3 = nn.Sequential(_conv(cin, c, 1), _conv(c, c, 3))
        self.b5 = nn.Sequential(_conv(cin, c, 1), _conv(c, c, 5))
        self.pool = nn.Sequential(nn.MaxPool2d(3, stride=1, padding=1), _conv(cin, c, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.b1(x), self.b3(x), self.b5(x), self.pool(x)], dim=1)


class SepConv(nn.Module):
    """Depthwise then pointwise convolution, as in NASNet's separable branches."""

    def __init__(self, c: int, k: int) -> None:
        super().__init__()
        self.depthwise = nn.Conv2d(c, c, k, padding=k // 2, groups=c, bias=False)
        self.pointwise = nn.Conv2d(c, c, 1, bias=False)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.pointwise(self.depthwise(torch.relu(x))))


class NasNetCell(nn.Module):
    """Five pairwise combinations of the previous two cell outputs, concatenated and projected."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.sep3_cur, self.sep5_cur = SepConv(c, 3), SepConv(c, 5)
        self.sep3_prev, self.sep5_prev = SepConv(c, 3), SepConv(c, 5)
        self.sep3_prev_b = SepConv(c, 3)
        self.avg = nn.AvgPool2d(3, stride=1, padding=1)
        self.project = _conv(5 * c, c, 1)

    def forward(self, prev: torch.Tensor, cur: torch.Tensor) -> torch.Tensor:
        b0 = self.sep3_cur(cur) + cur
        b1 = self.sep3_prev(prev) + self.sep5_cur(cur)
        b2 = self.avg(cur) + prev
        b3 = self.avg(prev) + self.avg(cur)
        b4 = self.sep5_prev(prev) + self.sep3_prev_b(prev)
        return self.project(torch.cat([b0, b1, b2, b3, b4], dim=1))


class BasicBlock(nn.Module):
    """Two 3x3 convolutions plus a shortcut (a 1x1 projection when the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class _Head(nn.Module):
    def __init__(self, c: int, classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class _Stack(nn.Module):
    """Stem convolution, then the subclass's ``blocks`` and pooled linear ``head``."""

    blocks: nn.Module
    head: nn.Module

    def __init__(self) -> None:
        super().__init__()
        self.example_input_shape = (3, IMAGE_SIZE, IMAGE_SIZE)
        self.stem = _conv(3, CHANNELS, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)))


class InceptionStack(_Stack):
    """``BLOCKS`` Inception blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[InceptionBlock(CHANNELS, CHANNELS) for _ in range(BLOCKS)])
        self.head = _Head(CHANNELS, CLASSES)


class NasNetStack(_Stack):
    """``BLOCKS`` NASNet cells, each fed the two previous outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.cells = nn.ModuleList([NasNetCell(CHANNELS) for _ in range(BLOCKS)])
        self.head = _Head(CHANNELS, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        prev = cur = self.stem(x)
        for cell in self.cells:
            prev, cur = cur, cell(prev, cur)
        return self.head(cur)


class ResNetStack(_Stack):
    """``BLOCKS`` basic blocks, every other one halving the image."""

    def __init__(self) -> None:
        super().__init__()
        layers, cin = [], CHANNELS
        for i in range(BLOCKS):
            cout = CHANNELS * (2 if i % 2 else 1)
            layers.append(BasicBlock(cin, cout, stride=2 if i % 2 else 1))
            cin = cout
        self.blocks = nn.Sequential(*layers)
        self.head = _Head(cin, CLASSES)


NETS: dict[str, Callable[[], nn.Module]] = {
    "inception-stack": InceptionStack, "nasnet-stack": NasNetStack, "resnet-stack": ResNetStack}
"""Catalog name -> factory."""


def build_net(name: str, seed: int = 0) -> nn.Module:
    """A catalog net by name (weights drawn from ``seed``, the global RNG left as it was), or the
    module a ``package.module:function`` factory returns."""
    if name in NETS:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return NETS[name]()
    if ":" not in name:
        raise ValueError(f"unknown net {name!r}; choose one of {', '.join(NETS)} "
                         "or pass package.module:function returning an nn.Module")
    from meshmorph.spec.trace import build_module

    return build_module(name, meta=False)


def example_input(model: nn.Module, batch: int,
                  input_shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """A seeded random input of ``(batch, *shape)``; the shape from the module unless given."""
    shape = input_shape or getattr(model, "example_input_shape", None)
    if shape is None:
        raise ValueError(f"{type(model).__name__} has no example_input_shape attribute; "
                         "pass --input-shape C,H,W (one sample, no batch dimension)")
    if batch <= 0:
        raise ValueError(f"batch must be positive, got {batch}")
    values = batch * math.prod(shape)
    if values > MAX_INPUT_VALUES:
        raise ValueError(f"a batch of {batch} x {tuple(shape)} is {values:,} input values, above "
                         f"meshmorph's limit of {MAX_INPUT_VALUES:,} (2**24, 64 MiB of fp32) for "
                         "a net traced on this CPU; pass a smaller --batch or --input-shape")
    return torch.randn((batch, *shape), generator=torch.Generator().manual_seed(0))
