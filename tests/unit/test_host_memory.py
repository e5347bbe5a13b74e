"""A job whose steps this machine cannot hold is refused before any process starts."""

from __future__ import annotations

import pytest

from meshmorph.run.launch.host_memory import check_host_memory, rank_step_bytes
from meshmorph.spec.catalog import load_model
from meshmorph.spec.plan import Plan

MODEL = load_model("gpt-tiny", 32)


def _plan(global_batch: int, dp: int = 2, micro_batch: int = 2) -> Plan:
    return Plan(model="gpt-tiny", seq_len=32, global_batch=global_batch, dp=dp,
                micro_batch=micro_batch, num_microbatches=global_batch // (dp * micro_batch),
                dtype="fp32").with_even_stages(MODEL)


def test_the_token_ids_of_a_step_are_three_int64_copies_of_the_ranks_share() -> None:
    ids, activations = rank_step_bytes(MODEL, _plan(1_000_000))
    assert ids == 3 * 500_000 * 33 * 8
    assert activations == rank_step_bytes(MODEL, _plan(8))[1] > 0  # per micro-batch: the same


def test_a_batch_beyond_the_machine_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"\[train\] global_batch 1000000000 x seq_len 32: each "
                                         r"of the 2 ranks holds at least 368.8 GiB of token ids"):
        check_host_memory(MODEL, _plan(1_000_000_000), 2, memory_bytes=24 * 2**30)
    check_host_memory(MODEL, _plan(65_536), 2, memory_bytes=24 * 2**30)  # 25 MiB: fine
