"""validate's phase clocks (profile/validate_phases.py) on a stand-in engine whose forward,
backward, reduction wait, optimizer and tail take known sleeps."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from meshmorph.profile.validate_phases import PHASES, StepPhases

# every sleep at least 0.1 s: a phase that took another's sleep would be over by >= 0.1 s, far
# beyond what a loaded machine's scheduler adds to one sleep
FORWARD, BACKWARD, WAIT, OPTIMIZER, TAIL = 0.1, 0.2, 0.3, 0.15, 0.25


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        time.sleep(BACKWARD)
        return grad


class _Chunk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(FORWARD)
        return _SlowBackward.apply(self.lin(x))  # type: ignore[no-any-return]


class _SlowAdamW(torch.optim.AdamW):
    def step(self, closure: object = None) -> object:  # type: ignore[override]
        time.sleep(OPTIMIZER)
        return super().step()


class _Engine:
    """What StepPhases reads of a TrainEngine: runners, parameters, optimizers, the
    forward-and-backward phase (here: one micro-batch, then a wait as DDP's reducer's)."""

    def __init__(self) -> None:
        self.chunk = _Chunk()
        self._runners = [self.chunk]
        self._params = [list(self.chunk.parameters())]
        self.optimizers = [_SlowAdamW(self._params[0], lr=1e-3)]

    def _forward_backward(self, x: torch.Tensor) -> torch.Tensor:
        loss = self.chunk(x).sum()
        loss.backward()
        time.sleep(WAIT)  # after the last gradient: the reduction's wait
        return loss.detach()

    def step(self, x: torch.Tensor) -> None:
        self._forward_backward(x)
        time.sleep(TAIL)
        self.optimizers[0].step()


def test_step_phases_split_a_step_into_the_sleeps_it_took() -> None:
    torch.optim.AdamW([nn.Parameter(torch.ones(1))])  # hooks AdamW.step itself, as any earlier
    # AdamW in the process does: _SlowAdamW's super().step() then fires the step hooks again
    engine = _Engine()
    phases = StepPhases(engine)
    for _ in range(2):
        phases.begin()
        engine.step(torch.ones(2, 4))
        record = phases.end()
    assert list(record) == list(PHASES) and len(phases.records) == 2
    # each phase at least its sleep, and short of taking in the shortest other sleep
    for key, sleep in (("forward_s", FORWARD), ("backward_s", BACKWARD),
                       ("grad_reduce_wait_s", WAIT), ("optimizer_s", OPTIMIZER),
                       ("tail_other_s", TAIL)):
        assert sleep <= record[key] < sleep + min(FORWARD, BACKWARD, WAIT, OPTIMIZER, TAIL) - 0.005, (key, record)
    parts = sum(record[k] for k in PHASES[:5])
    assert parts == pytest.approx(record["step_s"], rel=1e-6)
    assert record["fwd_bwd_cpu_s"] < 0.5 * (FORWARD + BACKWARD + WAIT)  # sleeping is not CPU time


def test_step_phases_close_removes_the_hooks() -> None:
    engine = _Engine()
    phases = StepPhases(engine)
    phases.close()
    phases.begin()
    engine.step(torch.ones(2, 4))
    record = phases.end()
    assert record["forward_s"] == 0.0 and record["optimizer_s"] == 0.0
    # without the gradient hooks the backward phase ends with forward_backward: no wait split off
    assert record["grad_reduce_wait_s"] == 0.0
