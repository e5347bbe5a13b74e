"""The asynchronous pipeline executor on the 4 gloo processes of the ``world4`` job (one part,
every check in it):
stashing's gradients equal a hand-rolled PipeDream reference, synchronous 1F1B equals one
process, SGD weight prediction trains and repeats itself exactly, and the guard's fallback to
flushing drains and finishes the run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.world import Part, part_folder

STAGES, BATCH = 4, 16


def reference(seed: int, batches: int, micro: int, version, momentum: float = 0.9,  # type: ignore[no-untyped-def]
              lr: float = 0.05) -> tuple[list, list]:
    """One process, the whole model: micro-batch j runs stage k with the weights after
    ``version(k, j)`` updates of that stage (its history kept); each batch is cut into ``micro``
    micro-batches whose mean-loss gradients are summed / ``micro``; momentum SGD per stage.
    Returns (each backward's gradient per stage, final parameters per stage)."""
    import torch
    import torch.nn.functional as F
    from torch.func import functional_call

    from meshmorph.demos.digits import batch_source, build_stage, digits

    x_tr, y_tr, _, _ = digits()
    stages = [build_stage(k, STAGES, seed) for k in range(STAGES)]
    opts = [torch.optim.SGD(s.parameters(), lr=lr, momentum=momentum) for s in stages]
    history = [[{n: t.detach().clone() for n, t in s.named_parameters()}] for s in stages]
    grads: list[list] = [[] for _ in stages]
    source = batch_source(x_tr, y_tr, BATCH, seed)
    size = BATCH // micro
    for b in range(batches):
        x, y = source(b)
        for piece in range(micro):
            j = b * micro + piece
            h, leaves = x[piece * size:(piece + 1) * size], []
            for k, stage in enumerate(stages):
                w = {n: t.clone().requires_grad_()
                     for n, t in history[k][version(k, j)].items()}
                leaves.append(w)
                h = functional_call(stage, w, (h,))
            (F.cross_entropy(h, y[piece * size:(piece + 1) * size]) / micro).backward()
            for k, stage in enumerate(stages):
                grads[k].append([leaves[k][n].grad for n, _ in stage.named_parameters()])
                for n, t in stage.named_parameters():
                    t.grad = leaves[k][n].grad.clone() if t.grad is None \
                        else t.grad + leaves[k][n].grad
            if micro == 1 or piece == micro - 1:
                for k, opt in enumerate(opts):
                    opt.step()
                    opt.zero_grad()
                    history[k].append({n: t.detach().clone()
                                       for n, t in stages[k].named_parameters()})
    return grads, [[t.detach() for t in s.parameters()] for s in stages]


def async_part(rank: int, world_size: int, folder: Path) -> None:
    import torch
    import torch.nn.functional as F

    from meshmorph.run.async_pipe.config import AsyncPipelineConfig
    from meshmorph.demos.digits import batch_source, build_stage, digits, feature_shapes
    from meshmorph.run.async_pipe.executor import AsyncPipeline

    x_tr, y_tr, _, _ = digits()

    def run(config: AsyncPipelineConfig, batches: int, seed: int = 3):  # type: ignore[no-untyped-def]
        stage = build_stage(rank, world_size, seed)
        pipe = AsyncPipeline(stage, config, feature_shapes=feature_shapes(world_size),
                             loss_fn=F.cross_entropy)
        result = pipe.train(batch_source(x_tr, y_tr, BATCH, seed), batches, BATCH)
        return result, [t.detach().clone() for t in stage.parameters()]

    def max_diff(a: list, b: list) -> float:
        return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))

    out: dict[str, object] = {"rank": rank}
    # 1. stashing: micro-batch j's forward and backward on stage k both use the weights after
    #    max(0, j - (p - 1 - k)) updates (PipeDream), and each backward's gradient matches
    lag = world_size - 1 - rank
    stash, stash_params = run(AsyncPipelineConfig(weight_prediction="stash", record_grads=10), 10)
    ref_grads, ref_params = reference(3, 10, 1, lambda k, j: max(0, j - (STAGES - 1 - k)))
    out["stash_grad_diff"] = max(max_diff(g, r) for g, r in zip(stash.grads, ref_grads[rank],
                                                                 strict=True))
    out["stash_param_diff"] = max_diff(stash_params, ref_params[rank])
    out["stash_grads"] = len(stash.grads)
    # ... and the weights it used really were stale: with fresh ones the gradient differs
    fresh_grads, _ = reference(3, 10, 1, lambda k, j: j)
    out["stash_vs_fresh"] = max_diff(stash.grads[-1], fresh_grads[rank][9]) if lag else None
    # 2. synchronous 1F1B (4 micro-batches a step) equals one process accumulating them
    sync, sync_params = run(AsyncPipelineConfig(synchronous=True, num_microbatches=4), 6)
    _, one_params = reference(3, 6, 4, lambda k, j: j // 4)
    out["sync_param_diff"] = max_diff(sync_params, one_params[rank])
    out["sync_moved"] = max_diff(sync_params, [t.detach() for t in
                                               build_stage(rank, world_size, 3).parameters()])
    # 3. SGD prediction trains and repeats itself bit for bit
    predicted = AsyncPipelineConfig(weight_prediction="sgd", lr=0.03, guard_threshold=None)
    first, first_params = run(predicted, 60)
    second, second_params = run(predicted, 60)
    out["predict_losses_head_tail"] = [sum(first.losses[:10]) / 10, sum(first.losses[-10:]) / 10]
    out["predict_repeat_equal"] = first.losses == second.losses and all(
        torch.equal(a, b) for a, b in zip(first_params, second_params, strict=True))
    # 4. a guard with threshold 0 trips at its first check (after B(7)), drains micro-batches
    #    up to 7 + p - 1 and flushes the remaining batches
    guarded, _ = run(AsyncPipelineConfig(weight_prediction="sgd", guard_threshold=0.0,
                                         guard_every=8), 24)
    out["guard_switched_at"] = guarded.switched_at
    out["guard_losses"] = len(guarded.losses)
    (folder / f"rank{rank}.json").write_text(json.dumps(out))


WORLD_PARTS = [Part("async_pipeline", async_part, world=STAGES, timeout_s=120)]


@pytest.mark.dist
@pytest.mark.timeout(60, func_only=True)
def test_async_pipeline_stash_matches_reference_sync_matches_one_process_prediction_trains(
        world4: Path) -> None:
    folder = part_folder(world4, "async_pipeline")
    rows = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(STAGES)]
    assert [row["rank"] for row in rows] == [0, 1, 2, 3]
    for row in rows:
        assert row["stash_grads"] == 10
        assert row["stash_grad_diff"] <= 1e-6, row
        assert row["stash_param_diff"] <= 1e-6, row
        if row["rank"] < STAGES - 1:
            assert row["stash_vs_fresh"] > 1e-4, row  # staleness was real
        assert row["sync_param_diff"] <= 1e-6, row
        assert row["sync_moved"] > 1e-3, row
        assert row["predict_repeat_equal"] is True
        assert row["guard_switched_at"] == 7 + STAGES - 1 + 1
    last = rows[-1]
    head, tail = last["predict_losses_head_tail"]
    assert tail < head - 0.1, last  # 60 steps took the loss from ~2.30 (ln 10) to ~2.13
    assert last["guard_losses"] == 24  # every batch trained, async then flushed
