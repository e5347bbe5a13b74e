"""Profile pieces taken on several ranks at once: compute as the slowest rank did it, collectives
as the last rank to reach them saw them, ZeRO-1's tail without its all-gather — on hand-made
per-rank figures (the all-gather over ranks is replaced by the figures it would return)."""

from __future__ import annotations

import pytest
import torch

from meshmorph.cost.profile import layer_key
from meshmorph.profile import fsdp_units, hardware, layers
from meshmorph.profile.fsdp_units import FsdpUnits
from meshmorph.profile.hardware import CollectiveSamples
from meshmorph.profile.layers import LayerPasses, OptimizerTails
from meshmorph.spec.catalog import catalog_model

MODEL = catalog_model("gpt-small", 16)


@pytest.fixture
def two_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.distributed as seen by rank 0 of 2 (no barrier is taken: ``timed`` reads
    ``is_initialized`` from its own module)."""
    for module in (layers, hardware, fsdp_units):
        monkeypatch.setattr(module.dist, "get_world_size", lambda *a: 2)
    monkeypatch.setattr(layers.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(layers.dist, "barrier", lambda *a: None)


def test_layer_passes_keep_the_slowest_ranks_pass(two_ranks: None,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    passes = LayerPasses(MODEL, 1, "fp32", torch.device("cpu"), slowest=True)
    seen: list[list[float]] = []

    def every_rank(values: list[float]) -> list[list[float]]:
        seen.append(values)
        # rank 1 took three times as long on every layer
        return [list(values), [3 * v for v in values]]

    monkeypatch.setattr(layers, "every_rank", every_rank)
    passes.sample()
    key = layer_key(MODEL.name, MODEL.seq_len, 1, "fp32", 1)
    mine = seen[0]
    n = len(passes.layers)
    assert passes.fwd[1][0] == pytest.approx(3 * mine[1])  # forward rows first, then backward
    assert passes.bwd[1][0] == pytest.approx(3 * mine[n + 1])
    assert passes.times()[key]["fwd_s"] == pytest.approx(3 * mine[1])


def test_layer_passes_keep_their_own_pass_where_they_are_the_slowest(
        two_ranks: None, monkeypatch: pytest.MonkeyPatch) -> None:
    passes = LayerPasses(MODEL, 1, "fp32", torch.device("cpu"), slowest=True)
    seen: list[list[float]] = []

    def every_rank(values: list[float]) -> list[list[float]]:
        seen.append(values)
        return [list(values), [0.5 * v for v in values]]  # rank 1 twice as fast

    monkeypatch.setattr(layers, "every_rank", every_rank)
    passes.sample(passes=2)
    n = len(passes.layers)
    mine = seen[0]  # forward [layer][pass], then backward [layer][pass]
    assert [passes.fwd[k] for k in range(n)] == [mine[2 * k:2 * k + 2] for k in range(n)]
    assert [passes.bwd[k] for k in range(n)] == [mine[2 * n + 2 * k:2 * n + 2 * k + 2]
                                                 for k in range(n)]


def test_collective_samples_keep_the_least_time_over_the_groups_members(
        two_ranks: None, monkeypatch: pytest.MonkeyPatch) -> None:
    samples = CollectiveSamples.__new__(CollectiveSamples)
    samples.sizes = [1000.0, 3000.0]
    samples.last_arrival = True
    samples.calls = {"all_reduce/2": [lambda: None, lambda: None],
                     "send_recv/2": [lambda: None, lambda: None]}
    samples.members = set(samples.calls)
    samples.seconds = {k: [[], []] for k in samples.calls}
    # rank 0 reached every call first and waited 10 ms for rank 1 (send/recv halved)
    rank1 = [0.002, 0.004, 0.001, 0.003]
    monkeypatch.setattr(hardware, "every_rank",
                        lambda v: [[t + 0.01 for t in rank1], list(rank1)])
    samples.sample()
    assert samples.seconds["all_reduce/2"] == [[0.002], [0.004]]
    assert samples.seconds["send_recv/2"] == [[0.001], [0.003]]
    samples.sample(keep=False)
    assert samples.seconds["all_reduce/2"] == [[0.002], [0.004]]


class FakePair:
    """Records the passes and set-ups FsdpUnits.sample asks of a pair of units."""

    def __init__(self) -> None:
        self.root, self.plain = "fsdp", "plain"
        self.calls: list[str] = []

    def run(self, module: str) -> None:
        self.calls.append(module)

    def set_up(self, keep_gathered: bool) -> None:
        self.calls.append("kept" if keep_gathered else "resharded")


def test_fsdp_units_keep_each_calls_least_time_over_the_ranks(
        two_ranks: None, monkeypatch: pytest.MonkeyPatch) -> None:
    units = FsdpUnits.__new__(FsdpUnits)
    units.last_arrival, units.repeats = True, 2
    pair = FakePair()
    units.pairs = [pair]  # type: ignore[list-item]
    units.gather_s, units.scatter_s = [[]], [[]]
    # per call (plain, kept, resharded passes): rank 0 waited for rank 1 in the first call
    monkeypatch.setattr(fsdp_units, "every_rank",
                        lambda v: [[0.20, 0.50, 0.90, 0.21, 0.33, 0.49],
                                   [0.25, 0.30, 0.62, 0.20, 0.32, 0.50]])
    units.sample()
    # two units: a reduce-scatter each in the kept pass, a gather each in forward and backward
    assert units.scatter_s == [pytest.approx([0.05, 0.06])]
    assert units.gather_s == [pytest.approx([0.08, 0.0425])]
    assert pair.calls == ["plain", "kept", "fsdp", "resharded", "fsdp"] * 2
    units.sample(keep=False)
    assert units.gather_s == [pytest.approx([0.08, 0.0425])]


def test_fsdp_unit_fits_take_the_calls_of_the_window_only() -> None:
    units = FsdpUnits.__new__(FsdpUnits)
    units.world, units.repeats = 2, 3
    units.sizes, units.grad_sizes = [1e6, 2e6], [1e6, 2e6]
    # three samples of three calls; the middle sample is 10x slower
    line = [[1e-3 + 1e-9 * b * f for f in (1, 10, 1) for _ in range(3)] for b in units.sizes]
    units.gather_s = [list(r) for r in line]
    units.scatter_s = [[2 * t for t in r] for r in line]
    fits = units.fits(slice(0, 1))
    assert fits["fsdp_all_gather/2"]["beta_s_per_byte"] == pytest.approx(1e-9)
    assert fits["fsdp_reduce_scatter/2"]["alpha_s"] == pytest.approx(2e-3)
    assert units.fits(slice(1, 2))["fsdp_all_gather/2"]["beta_s_per_byte"] == pytest.approx(1e-8)


def test_tails_take_every_repeat_of_the_window() -> None:
    tails = OptimizerTails.__new__(OptimizerTails)
    tails.counts, tails.gathered_bytes, tails.repeats = [1000.0, 2000.0], [0.0, 0.0], 3
    # per-parameter 1 us, fixed 1 ms; sample 1 of each chunk is 5x slower
    tails.seconds = [[(1e-3 + 1e-6 * c) * f for f in (1, 5) for _ in range(3)]
                     for c in tails.counts]
    fixed, per_param = tails.fit(slice(0, 1))
    assert fixed == pytest.approx(1e-3) and per_param == pytest.approx(1e-6)
    fixed, per_param = tails.fit(slice(1, 2))
    assert fixed == pytest.approx(5e-3) and per_param == pytest.approx(5e-6)


def test_tails_fit_the_line_through_each_chunks_median() -> None:
    tails = OptimizerTails.__new__(OptimizerTails)
    tails.counts, tails.repeats = [1000.0, 2000.0, 4000.0], 1
    # update: 1 ms + 1 us per shard parameter; one outlier per chunk the median leaves out
    tails.seconds = [[1e-3 + 1e-6 * c, 1e-3 + 1e-6 * c, 1.0] for c in tails.counts]
    fixed, per_param = tails.fit()
    assert fixed == pytest.approx(1e-3) and per_param == pytest.approx(1e-6)
    tails.seconds = [[5e-3 - 1e-6 * c] * 3 for c in tails.counts]  # never below 0
    assert tails.fit()[1] == 0.0
