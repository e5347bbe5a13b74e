"""Activations moved between layer strategies on the 4 gloo processes of the ``world4`` job equal
the single-process slices, forward and backward."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.world import Part, part_folder

CHAIN = ((1, 4), (2, 2), (4, 1), (1, 4), (4, 1), (2, 2), (1, 4))
"""(tp, dp) of successive layers: every gather and slice between 1, 2 and 4."""


def chain_matches_reference(rank: int, world_size: int, out: Path) -> None:
    import torch

    from meshmorph.run.parallel.redistribute import LayoutGroups, redistribute

    generator = torch.Generator().manual_seed(0)
    batch, seq, hidden = 8, 3, 5
    x_all = torch.randn(batch, seq, hidden, generator=generator, dtype=torch.float64)
    weight = torch.randn(batch, seq, hidden, generator=generator, dtype=torch.float64)
    layouts = LayoutGroups(0, world_size)
    for low, high in ((1, 2), (1, 4), (2, 4)):  # every rank makes every group, in one order
        layouts.groups(low, high)

    def block(tp: int, dp: int) -> slice:
        size = batch // dp
        return slice((rank // tp) * size, (rank // tp + 1) * size)

    tp0, dp0 = CHAIN[0]
    x = x_all[block(tp0, dp0)].clone().requires_grad_(True)
    y = x
    for (tp_a, _), (tp_b, dp_b) in zip(CHAIN, CHAIN[1:], strict=False):
        y = redistribute(y, tp_a, tp_b, layouts)
        # the moved activation is exactly the single-process slice of layer b's block
        assert torch.equal(y.detach(), x_all[block(tp_b, dp_b)]), (rank, tp_a, tp_b)
        if tp_b > tp_a:  # the gathered buffer is B / dp_b x s x h elements (cost/transition.py)
            assert y.numel() == batch // dp_b * seq * hidden
    tp_n, dp_n = CHAIN[-1]
    (y * weight[block(tp_n, dp_n)]).sum().backward()
    # d(sum over the batch of y * w)/dx = w on this rank's own block: nothing lost or doubled
    assert x.grad is not None
    assert torch.equal(x.grad, weight[block(tp0, dp0)]), rank
    (out / f"rank{rank}.txt").write_text(
        f"rank {rank}: chain of {len(CHAIN) - 1} redistributions equal to reference")


WORLD_PARTS = [Part("layerwise_redistribute", chain_matches_reference, world=4, timeout_s=60)]


@pytest.mark.dist
@pytest.mark.timeout(60, func_only=True)
def test_redistribution_chain_equals_single_process_slices_and_gradients(world4: Path) -> None:
    out = part_folder(world4, "layerwise_redistribute")
    outputs = [path.read_text() for path in sorted(out.glob("rank*.txt"))]
    assert sum("equal to reference" in out for out in outputs) == 4
