"""One rank's state out of an engine and into a fresh one without torch.distributed: parameters,
both AdamW moments, step, LR schedule and the fp16 loss scaler arrive equal (``local_state``'s
in-place install, and the state-dict path it falls back to)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from meshmorph.elastic.live.local_state import _install_by_state_dict, extract_state, install_state
from meshmorph.run.engine.loss_scale import LossScaler


@dataclass
class FakeEngine:
    """What extract_state and install_state read of a TrainEngine, on one plain module."""

    seed: int
    model_parts: list[nn.Module] = field(default_factory=list)
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    lr_schedulers: list[Any] = field(default_factory=list)
    scaler: LossScaler = field(default_factory=LossScaler)
    spec: Any = field(default_factory=lambda: SimpleNamespace(tied_embeddings=False))
    plan: Any = field(default_factory=lambda: SimpleNamespace(to_json=lambda: "{}"))

    def __post_init__(self) -> None:
        torch.manual_seed(self.seed)
        part = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
        opt = torch.optim.AdamW(part.parameters(), lr=1e-2, foreach=True)
        self.model_parts, self.optimizers = [part], [opt]
        self.lr_schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))]


def _trained() -> FakeEngine:
    engine = FakeEngine(seed=1)
    for _ in range(2):
        engine.model_parts[0](torch.randn(4, 6)).square().sum().backward()
        engine.optimizers[0].step()
        engine.lr_schedulers[0].step()
        engine.optimizers[0].zero_grad()
    engine.scaler = LossScaler(scale=1024.0, good_steps=7, skipped_steps=2)
    return engine


@pytest.mark.parametrize("path", ["in_place", "state_dict"])
def test_state_and_loss_scaler_arrive_equal(path: str) -> None:
    old = _trained()
    state = extract_state(old, consumed_samples=96)
    new = FakeEngine(seed=2)
    if path == "in_place":
        install_state(new, state.pieces, state.small)
    else:  # the fallback alone, then the shared tail through install_state's own steps
        _install_by_state_dict(new, state.pieces, state.small)
        install_state(new, state.pieces, state.small)
    for a, b in zip(old.model_parts[0].parameters(), new.model_parts[0].parameters(), strict=True):
        assert torch.equal(a, b)
        sa, sb = old.optimizers[0].state[a], new.optimizers[0].state[b]
        assert torch.equal(sa["exp_avg"], sb["exp_avg"])
        assert torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
        assert float(sb["step"]) == 2.0
    assert new.optimizers[0].param_groups[0]["lr"] == old.optimizers[0].param_groups[0]["lr"]
    assert new.lr_schedulers[0].last_epoch == 2
    assert (new.scaler.scale, new.scaler.good_steps, new.scaler.skipped_steps) == (1024.0, 7, 2)
    assert state.small.consumed_samples == 96
