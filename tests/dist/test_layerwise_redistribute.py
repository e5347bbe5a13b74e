"""Activations moved between layer strategies on 4 gloo processes equal the single-process
slices, forward and backward."""

from __future__ import annotations

import pytest
from spawn import spawn

CHAIN = ((1, 4), (2, 2), (4, 1), (1, 4), (4, 1), (2, 2), (1, 4))
"""(tp, dp) of successive layers: every gather and slice between 1, 2 and 4."""


def chain_matches_reference(rank: int, world_size: int) -> None:
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
    print(f"rank {rank}: chain of {len(CHAIN) - 1} redistributions equal to reference")


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_redistribution_chain_equals_single_process_slices_and_gradients() -> None:
    outputs = spawn(chain_matches_reference, 4, timeout_s=150)
    assert sum("equal to reference" in out for out in outputs) == 4
