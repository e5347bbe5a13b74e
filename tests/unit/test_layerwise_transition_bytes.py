"""The transition cost prices what the runtime's redistribution sends.

run/parallel/redistribute.py's ``redistribute`` and ``redistribute_sequence`` run here on four
threads, one per rank of a stage, over an in-process stand-in for ``torch.distributed`` that
moves the tensors between the threads and counts, per rank and direction (forward, backward),
the bytes each rank sends to and receives from other ranks and the ranks it talks to. For every
pair of tp degrees in {1, 2, 4}, with sequence parallelism on and off, the busiest rank's figures
must equal ``Transition.fwd_bytes`` / ``bwd_bytes``, and the priced seconds must equal the
alpha-beta time of that rank's messages; the moved activations must be the layout's own slices
(so the stand-in moves what torch would).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

import pytest
import torch

import meshmorph.run.parallel.redistribute as runtime
from meshmorph.cost.model import CostModel
from meshmorph.cost.transition import transition
from meshmorph.spec.catalog import load_model
from meshmorph.spec.cluster import parse_cluster
from meshmorph.spec.plan import LayerStrategy

DEVICES = 4
SEQUENCES = 8
"""B: sequences of one stage micro-batch."""


class ThreadedDist:
    """``get_rank``, ``new_group``, ``all_gather_into_tensor`` and ``all_to_all_single`` for
    ``world`` threads that call every collective together; counts what crosses between ranks."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.local = threading.local()
        self.barrier = threading.Barrier(world, timeout=30)
        self.slots: dict[int, Any] = {}
        self.sent: dict[tuple[int, str], int] = defaultdict(int)
        self.received: dict[tuple[int, str], int] = defaultdict(int)
        self.targets: dict[tuple[int, str], set[int]] = defaultdict(set)
        self.sources: dict[tuple[int, str], set[int]] = defaultdict(set)

    def get_rank(self) -> int:
        return self.local.rank

    @staticmethod
    def new_group(ranks: list[int]) -> tuple[int, ...]:
        return tuple(ranks)

    def _exchange(self, value: Any) -> dict[int, Any]:
        self.barrier.wait()
        self.slots[self.local.rank] = value
        self.barrier.wait()
        seen = dict(self.slots)
        self.barrier.wait()
        return seen

    def _count(self, peer: int, sent: int, received: int) -> None:
        key = (self.local.rank, self.local.phase)
        if sent:
            self.targets[key].add(peer)
        if received:
            self.sources[key].add(peer)
        self.sent[key] += sent
        self.received[key] += received

    def all_gather_into_tensor(self, out: torch.Tensor, x: torch.Tensor, group: Any) -> None:
        seen = self._exchange(x.clone())
        me = self.local.rank
        out.copy_(torch.cat([seen[r] for r in group]))
        for r in group:
            if r != me:  # this rank's shard goes to r, r's comes here
                nbytes = x.numel() * x.element_size()
                self._count(r, nbytes, nbytes)

    def all_to_all_single(self, out: torch.Tensor, send: torch.Tensor, out_splits: list[int],
                          in_splits: list[int], group: Any) -> None:
        seen = self._exchange((send.clone(), list(in_splits)))
        me = self.local.rank
        pos = group.index(me)
        pieces = []
        for q, source in enumerate(group):
            buffer, splits = seen[source]
            assert splits[pos] == out_splits[q], "send and receive splits disagree"
            start = sum(splits[:pos])
            pieces.append(buffer[start:start + splits[pos]])
            if source != me:
                self._count(source, in_splits[q] * send.element_size(),
                            splits[pos] * send.element_size())
        out.copy_(torch.cat(pieces))


def _expected(x_all: torch.Tensor, rank: int, tp: int, sp: bool) -> torch.Tensor:
    """Rank ``rank``'s part of the stage micro-batch ``x_all`` under tp (module docstrings of
    cost/transition.py and run/parallel/redistribute.py)."""
    size = SEQUENCES // (DEVICES // tp)
    block = x_all[(rank // tp) * size:(rank // tp + 1) * size]
    if not sp or tp == 1:
        return block
    width = x_all.shape[1] // tp
    return block[:, (rank % tp) * width:(rank % tp + 1) * width]


def _run(tp_a: int, tp_b: int, sp: bool, seq: int, hidden: int) -> ThreadedDist:
    fake = ThreadedDist(DEVICES)
    generator = torch.Generator().manual_seed(0)
    x_all = torch.randn(SEQUENCES, seq, hidden, generator=generator)
    weight = torch.randn(SEQUENCES, seq, hidden, generator=generator)
    layouts = runtime.LayoutGroups(0, DEVICES)
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            fake.local.rank, fake.local.phase = rank, "fwd"
            mine = runtime.LayoutGroups(0, DEVICES)
            mine._made = layouts._made
            mine.tp_groups = {t: tuple(range(rank // t * t, rank // t * t + t)) for t in (2, 4)}
            x = _expected(x_all, rank, tp_a, sp).clone().requires_grad_(True)
            move = runtime.redistribute_sequence if sp else runtime.redistribute
            y = move(x, tp_a, tp_b, mine)
            assert torch.equal(y.detach(), _expected(x_all, rank, tp_b, sp)), (rank, "forward")
            fake.barrier.wait()
            fake.local.phase = "bwd"
            (y * _expected(weight, rank, tp_b, sp)).sum().backward()
            # the gradient of sum(y * w) over the layout: every replica of x gets w's slice
            # (the runtime sums nothing: a replicated gradient comes back as one copy)
            assert x.grad is not None
            assert torch.equal(x.grad, _expected(weight, rank, tp_a, sp)), (rank, "backward")
        except BaseException as error:  # noqa: BLE001 - reported below, per rank
            errors.append(error)
            fake.barrier.abort()

    original = runtime.dist
    runtime.dist = fake  # type: ignore[assignment]
    try:
        for low, high in ((1, 2), (1, 4), (2, 4)):  # the groups, made once, before the threads
            layouts.groups(low, high)
        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(DEVICES)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        runtime.dist = original
    if errors:
        raise errors[0]
    return fake


PAIRS = [(a, b) for a in (1, 2, 4) for b in (1, 2, 4) if a != b]


@pytest.mark.parametrize("sp", [False, True], ids=["no-sp", "sp"])
@pytest.mark.parametrize(("tp_a", "tp_b"), PAIRS)
def test_priced_bytes_equal_what_the_redistribution_sends(tp_a: int, tp_b: int, sp: bool) -> None:
    model = load_model("gpt-tiny")
    cost = CostModel(model, parse_cluster(f"a100-40g:1x{DEVICES}"))
    gpu = cost.default_gpu()
    fake = _run(tp_a, tp_b, sp, model.seq_len, model.hidden_size)
    step = transition(cost, LayerStrategy(tp=tp_a, dp=DEVICES // tp_a),
                      LayerStrategy(tp=tp_b, dp=DEVICES // tp_b), SEQUENCES, "fp32", gpu,
                      sequence_parallel=sp)
    link = cost.group_link(gpu, max(tp_a, tp_b))
    for phase, priced_bytes, priced_s in (("fwd", step.fwd_bytes, step.fwd_s),
                                          ("bwd", step.bwd_bytes, step.bwd_s)):
        ranks = range(DEVICES)
        moved = [max(fake.sent[r, phase], fake.received[r, phase]) for r in ranks]
        assert priced_bytes == max(moved), (phase, moved)
        # each direction of a link runs on its own: a rank's sends, or its receives, whichever
        # take longer (messages x alpha + bytes / beta)
        seconds = [max(len(fake.targets[r, phase]) * link.latency_s
                       + fake.sent[r, phase] / link.bandwidth_bps,
                       len(fake.sources[r, phase]) * link.latency_s
                       + fake.received[r, phase] / link.bandwidth_bps)
                   if moved[r] else 0.0 for r in ranks]
        assert priced_s == pytest.approx(max(seconds), rel=1e-12), phase
    if sp and min(tp_a, tp_b) > 1:  # the case the ring formula missed: a rank sends all of it
        whole = SEQUENCES * model.seq_len * model.hidden_size * 4 / DEVICES
        assert max(fake.sent[r, "fwd"] for r in range(DEVICES)) == whole
