"""The vocabulary-parallel loss (run/model/loss.py) equals the cross-entropy of whole, unpadded logits.

On the 2 gloo processes of the ``world2`` job, logits of a padded vocabulary (251 real columns
of 256) sharded on the vocabulary go through ``mask_padded_vocab`` and ``token_cross_entropy`` (torch's loss_parallel);
the loss and the gradient of every real column must equal ``F.cross_entropy`` over the first
251 columns of the whole tensor, the pad columns' gradient must be exactly 0, and the collectives
counted must be loss_parallel's three fp32 all-reduces of one value per token.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.world import Part, part_folder

pytestmark = pytest.mark.dist

VOCAB, PADDED, B, S = 251, 256, 2, 5


def loss_part(rank: int, world: int, out: Path) -> None:
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from meshmorph.run.engine.comm_count import CommCounter
    from meshmorph.run.model.loss import mask_padded_vocab, token_cross_entropy

    generator = torch.Generator().manual_seed(3)
    whole = torch.randn(B, S, PADDED, generator=generator, dtype=torch.float64).float()
    labels = torch.randint(0, VOCAB, (B, S), generator=generator)
    reference = whole[..., :VOCAB].clone().requires_grad_(True)
    expected = F.cross_entropy(reference.flatten(0, 1), labels.flatten())
    expected.backward()

    mesh = init_device_mesh("cpu", (world,))
    leaf = distribute_tensor(whole, mesh, [Shard(2)]).requires_grad_(True)
    counter = CommCounter()
    with counter:
        loss = token_cross_entropy(mask_padded_vocab(leaf, VOCAB), labels)
    loss.backward()
    grad = leaf.grad.full_tensor()
    if rank == 0:
        (out / "loss.json").write_text(json.dumps({
            "loss": float(loss), "expected": float(expected),
            "grad_gap": float((grad[..., :VOCAB] - reference.grad).abs().max()),
            "pad_grad": float(grad[..., VOCAB:].abs().max()),
            "plain": type(loss).__name__, "sent": counter.sent_bytes, "calls": counter.calls}))


WORLD_PARTS = [Part("loss_parallel", loss_part, world=2, timeout_s=60)]


@pytest.mark.timeout(60, func_only=True)
def test_vocab_parallel_loss_equals_whole_unpadded_cross_entropy(world2: Path) -> None:
    r = json.loads((part_folder(world2, "loss_parallel") / "loss.json").read_text())
    assert r["plain"] == "Tensor", f"the loss comes back as a {r['plain']}, not a plain tensor"
    assert abs(r["loss"] - r["expected"]) <= 1e-6 * abs(r["expected"]), r
    assert r["grad_gap"] <= 1e-7, f"real columns' gradient differs by {r['grad_gap']:.2e}"
    assert r["pad_grad"] == 0.0, f"pad columns got gradient {r['pad_grad']:.2e}"
    assert r["calls"]["all_reduce"] == 3 and r["sent"]["all_reduce"] == 3 * B * S * 4, r
    assert r["sent"]["all_gather"] == 0, r
