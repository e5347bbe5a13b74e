"""Deterministic data: nothing lost or repeated across dp splits and resumes; exact sources."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshmorph.run.data import (
    ByteTextFile,
    DataShard,
    SampleOrder,
    SyntheticTask,
    dp_share_range,
)


def test_sample_order_epoch_is_a_permutation_and_next_epoch_reshuffles() -> None:
    order = SampleOrder(10, seed=3)
    first, second = order.indices(0, 10), order.indices(10, 20)
    assert sorted(first.tolist()) == list(range(10))
    assert sorted(second.tolist()) == list(range(10))
    assert first.tolist() != second.tolist()
    assert first.tolist() == np.random.default_rng(3).permutation(10).tolist()
    assert second.tolist() == np.random.default_rng(4).permutation(10).tolist()  # seed + epoch


def test_range_across_an_epoch_boundary_equals_the_two_epochs_joined() -> None:
    order = SampleOrder(7, seed=0)
    joined = np.concatenate([order.indices(0, 7), order.indices(7, 14), order.indices(14, 21)])
    assert order.indices(5, 17).tolist() == joined[5:17].tolist()


@settings(max_examples=60, deadline=None)
@given(num_samples=st.integers(3, 50), dp_exp=st.integers(0, 3), per_rank=st.integers(1, 4),
       steps=st.integers(1, 12), resume_at=st.integers(0, 12), seed=st.integers(0, 99))
def test_every_dp_split_and_resume_point_sees_each_order_position_exactly_once(
        num_samples: int, dp_exp: int, per_rank: int, steps: int, resume_at: int, seed: int) -> None:
    dp = 2**dp_exp
    global_batch = dp * per_rank
    order = SampleOrder(num_samples, seed)
    expected = order.indices(0, steps * global_batch).tolist()
    resume_at = min(resume_at, steps)
    seen: list[int] = []
    for phase_dp, phase_steps in ((dp, range(resume_at)), (max(1, dp // 2), range(resume_at, steps))):
        for step in phase_steps:  # after the resume the run continues on half the ranks
            consumed = step * global_batch  # the only data-loader state
            for rank in range(phase_dp):
                start, stop = dp_share_range(consumed, global_batch, rank, phase_dp)
                seen.extend(order.indices(start, stop).tolist())
    assert seen == expected
    # every sample appears once per epoch: counts differ by at most one over the positions
    counts = np.bincount(np.array(seen, dtype=np.int64), minlength=num_samples)
    assert counts.max() - counts.min() <= 1


def test_dp_shares_concatenate_to_the_global_batch_exactly() -> None:
    task = SyntheticTask(vocab_size=64, seq_len=16, seed=5)
    order = SampleOrder(len(task), seed=1)
    consumed, global_batch = 40, 12
    whole = task.samples(order.indices(consumed, consumed + global_batch))
    for dp in (1, 2, 3, 4, 6, 12):
        shares = [DataShard(task, order, global_batch=global_batch, dp_rank=r, dp_size=dp)
                  .batch(consumed) for r in range(dp)]
        assert all(s.shape == (global_batch // dp, 17) for s in shares)
        assert torch.equal(torch.cat(shares), whole)


def test_dp_that_does_not_divide_the_batch_is_refused() -> None:
    with pytest.raises(ValueError, match="global_batch 10 is not divisible by dp 4"):
        dp_share_range(0, 10, 0, 4)


def test_synthetic_sample_depends_only_on_seed_and_index() -> None:
    task = SyntheticTask(vocab_size=32, seq_len=20, seed=7)
    again = SyntheticTask(vocab_size=32, seq_len=20, seed=7)
    other = SyntheticTask(vocab_size=32, seq_len=20, seed=8)
    batch = task.samples(np.array([9, 3, 9]))
    assert batch.dtype == torch.int64 and batch.shape == (3, 21)
    assert torch.equal(batch[0], batch[2])
    assert torch.equal(batch[1], again.sample(3))
    assert not torch.equal(task.sample(3), other.sample(3))
    assert int(batch.min()) >= 0 and int(batch.max()) < 32


def test_synthetic_tokens_follow_the_rule_except_for_noise() -> None:
    task = SyntheticTask(vocab_size=256, seq_len=128, seed=0, noise=0.1)
    rule = torch.from_numpy(task.rule())
    batch = task.samples(np.arange(64))
    follows = (batch[:, 1:] == rule[batch[:, :-1]]).double().mean().item()
    # a noise token hits the rule by chance with probability 1/256
    assert follows == pytest.approx(0.9 + 0.1 / 256, abs=0.01)
    # entropy floor a model can reach: far below ln(256) = 5.55, so the loss can visibly fall
    floor = -(0.9 * math.log(0.9 + 0.1 / 256) + 0.1 * math.log(0.1 / 256))
    assert floor < 1.2


def test_byte_text_file_windows_at_stride_seq_len(tmp_path) -> None:
    path = tmp_path / "t.txt"
    path.write_bytes(bytes(range(100)))
    data = ByteTextFile(path, seq_len=10)
    assert len(data) == 9  # (100 - 1) // 10 windows of 11 bytes
    assert data.sample(0).tolist() == list(range(11))
    assert data.sample(8).tolist() == list(range(80, 91))
    assert data.samples(np.array([2, 1])).tolist() == [list(range(20, 31)), list(range(10, 21))]


def test_missing_empty_or_short_text_file_is_refused_naming_the_path(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=r"data file .*nope\.txt does not exist"):
        ByteTextFile(tmp_path / "nope.txt", seq_len=8)
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.txt holds 0 bytes, fewer than one sample"):
        ByteTextFile(empty, seq_len=8)
    short = tmp_path / "short.txt"
    short.write_bytes(b"12345678")
    with pytest.raises(ValueError, match=r"short\.txt holds 8 bytes.*seq_len \+ 1 = 9"):
        ByteTextFile(short, seq_len=8)
