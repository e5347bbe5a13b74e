"""What the reshape tests share (tests/dist/test_reshape_*.py): gpt-tiny at global batch 8 on 4
processes, a step of one rank's share that records the sample ids it read, and the two checks
of a chain of steps over changing plans: the numbers of one device, every sample once."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from tests.helpers.oracle import (
    OPTIM,
    SEED,
    fp32_expectation,
    gpt_tiny,
    token_batches,
    violations,
)
from tests.helpers.reference import ReferenceRun

WORLD = 4
GLOBAL_BATCH = 8


def batches(steps: int) -> list[torch.Tensor]:
    """``steps`` global batches of gpt-tiny tokens (the equivalence matrix's seed)."""
    return token_batches(gpt_tiny(), GLOBAL_BATCH, steps)


def rank_step(engine: Any, batch: torch.Tensor, consumed: int) -> tuple[float, float, list[int]]:
    """One step on this rank's data-parallel share of ``batch``: loss, gradient norm and the
    sample ids (positions in the order) it read."""
    share = GLOBAL_BATCH // engine.dp_size
    lo = engine.dp_rank * share
    loss = engine.step(batch[lo:lo + share])
    return loss, engine.grad_norm_last(), list(range(consumed + lo, consumed + lo + share))


def assert_matches_one_device(entries: Iterable[dict], param_files: Iterable[Path],
                              steps: int) -> None:
    """Every rank of a step reports the same loss and grad norm, and the losses, norms and the
    parameters saved in ``param_files`` equal the fp64 one-device run within K times the
    measured fp32 noise (the equivalence matrix's rule, ``oracle.py``)."""
    by_step: dict[int, tuple[float, float]] = {}
    for entry in entries:
        got = (entry["loss"], entry["grad_norm"])
        assert by_step.setdefault(entry["step"], got) == got, entry
    assert sorted(by_step) == list(range(steps))
    params: dict[str, torch.Tensor] = {}
    for path in sorted(param_files):
        params.update(torch.load(path))
    run = ReferenceRun(tuple(by_step[s][0] for s in range(steps)),
                       tuple(by_step[s][1] for s in range(steps)), params)
    expectation = fp32_expectation(gpt_tiny(), batches(steps), micro_batch=1,
                                   noise_micro_batches=(1, 2, GLOBAL_BATCH), optim=OPTIM,
                                   seed=SEED)
    found = violations(run, expectation)
    assert not found, "\n".join(found)


def assert_every_sample_once(entries: Iterable[dict], steps: int) -> None:
    """Every rank of one dp rank read the same sample ids in a step, and over ``steps`` steps
    every sample id was consumed exactly once."""
    seen: dict[int, dict[int, list[int]]] = {}  # step -> dp rank -> sample ids
    for entry in entries:
        ids = seen.setdefault(entry["step"], {}).setdefault(entry["dp_rank"], entry["ids"])
        assert ids == entry["ids"]
    consumed = sorted(i for step in seen.values() for ids in step.values() for i in ids)
    assert consumed == list(range(steps * GLOBAL_BATCH))
