"""The spawn harness kills every rank on the first failure and shows every rank's output."""

from __future__ import annotations

import time

import pytest

from tests.helpers.spawn import SpawnError, spawn


def fail_while_peer_hangs(rank: int, world_size: int) -> None:
    print(f"rank {rank} of {world_size} started", flush=True)
    if rank == 1:
        time.sleep(1.0)
        raise RuntimeError("deliberate failure on rank 1")
    time.sleep(3600)  # rank 0 hangs


def add_ranks(rank: int, world_size: int) -> None:
    import torch
    import torch.distributed as dist

    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    print(f"sum {total.item():.0f}", flush=True)


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_first_failure_kills_hung_ranks_and_reports_every_rank() -> None:
    start = time.monotonic()
    with pytest.raises(SpawnError) as info:
        spawn(fail_while_peer_hangs, 2, timeout_s=90, collective_timeout_s=80)
    message = str(info.value)
    assert message.startswith("rank 1 exited with code 1\n")  # rank 0 was still running
    assert "rank 0 of 2 started" in message and "deliberate failure on rank 1" in message
    assert time.monotonic() - start < 60  # rank 0 was killed, not waited for


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_ranks_share_one_process_group_and_return_their_output() -> None:
    outputs = spawn(add_ranks, 2, timeout_s=90)
    assert [out.strip().splitlines()[-1] for out in outputs] == ["sum 3", "sum 3"]
