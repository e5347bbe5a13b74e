"""Deterministic data: a seeded sample order, two sample sources (``make_source`` picks a job's),
and each rank's share.

The whole data-loader state is one integer, ``consumed_samples``. Step k's global batch is
positions ``[consumed, consumed + global_batch)`` of the sample order, and data-parallel rank r
takes the contiguous slice ``[r * B / dp, (r + 1) * B / dp)`` of it. Any rank can build any sample
without communication, so a resume or a reshape to another dp degree loses and repeats nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from meshmorph.run.job import JobConfig
from meshmorph.spec.model import ModelSpec

# SyntheticTask: the order runs over this many distinct samples before an epoch ends
SYNTHETIC_NUM_SAMPLES = 1 << 17


class SampleOrder:
    """A seeded global permutation of ``num_samples`` indices, repeated epoch after epoch.

    Epoch e is permuted with seed ``seed + e``; position p of the order lies in epoch
    ``p // num_samples``, so positions past one epoch continue into the next.
    """

    def __init__(self, num_samples: int, seed: int) -> None:
        if num_samples < 1:
            raise ValueError(f"a sample order needs at least one sample, got {num_samples}")
        self.num_samples = num_samples
        self.seed = seed
        self._cache: dict[int, np.ndarray] = {}

    def epoch_permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._cache:
            if len(self._cache) >= 2:  # a batch spans at most two epochs at a time
                self._cache.pop(min(self._cache))
            rng = np.random.default_rng(self.seed + epoch)
            self._cache[epoch] = rng.permutation(self.num_samples)
        return self._cache[epoch]

    def indices(self, start: int, stop: int) -> np.ndarray:
        """Sample indices at order positions ``[start, stop)``."""
        if start < 0 or stop < start:
            raise ValueError(f"bad order range [{start}, {stop})")
        out = np.empty(stop - start, dtype=np.int64)
        pos = start
        while pos < stop:
            epoch, offset = divmod(pos, self.num_samples)
            take = min(stop - pos, self.num_samples - offset)  # up to the end of this epoch
            out[pos - start:pos - start + take] = self.epoch_permutation(epoch)[offset:offset + take]
            pos += take
        return out


def dp_share_range(consumed_samples: int, global_batch: int, dp_rank: int,
                   dp_size: int) -> tuple[int, int]:
    """Order positions ``[start, stop)`` that data-parallel rank ``dp_rank`` trains on next."""
    if global_batch % dp_size:
        raise ValueError(f"global_batch {global_batch} is not divisible by dp {dp_size}")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} outside [0, {dp_size})")
    per_rank = global_batch // dp_size  # B / dp sequences per data-parallel rank
    start = consumed_samples + dp_rank * per_rank  # consumed + r * B / dp
    return start, start + per_rank


@dataclass(frozen=True, slots=True)
class SyntheticTask:
    """Sequences that follow a fixed random token permutation, with noise.

    Token t+1 is ``rule[token t]`` with probability ``1 - noise``, else a uniform random token.
    A small model learns the rule in tens of steps, so the loss visibly falls from ``ln(vocab)``
    towards the noise floor. Sample i comes from a generator seeded by ``(seed, i)``.
    """

    vocab_size: int
    """Number of distinct tokens."""
    seq_len: int
    """Tokens a model sees per sample (each sample holds ``seq_len + 1`` for the shifted target)."""
    seed: int = 0
    """Seed of the rule and of every sample."""
    noise: float = 0.1
    """Probability that a token ignores the rule."""
    num_samples: int = SYNTHETIC_NUM_SAMPLES
    """Distinct samples in one epoch of the order."""

    def __post_init__(self) -> None:
        if self.vocab_size < 2 or self.seq_len < 1:
            raise ValueError(
                f"synthetic task needs vocab_size >= 2 and seq_len >= 1, got {self.vocab_size}, "
                f"{self.seq_len}"
            )
        if not 0.0 <= self.noise < 1.0:
            raise ValueError(f"noise must lie in [0, 1), got {self.noise}")

    def __len__(self) -> int:
        return self.num_samples

    def rule(self) -> np.ndarray:
        return np.random.default_rng([self.seed]).permutation(self.vocab_size)

    def sample(self, index: int) -> torch.Tensor:
        """LongTensor[seq_len + 1] for sample ``index``."""
        return self.samples(np.array([index]))[0]

    def samples(self, indices: np.ndarray) -> torch.Tensor:
        rule = self.rule()
        out = np.empty((len(indices), self.seq_len + 1), dtype=np.int64)
        for row, index in enumerate(indices):
            rng = np.random.default_rng([self.seed, int(index), 1])
            noise_tokens = rng.integers(0, self.vocab_size, size=self.seq_len + 1)
            keep_rule = rng.random(self.seq_len + 1) >= self.noise
            token = noise_tokens[0]
            out[row, 0] = token
            for pos in range(1, self.seq_len + 1):
                token = rule[token] if keep_rule[pos] else noise_tokens[pos]
                out[row, pos] = token
        return torch.from_numpy(out)


class ByteTextFile:
    """A plain text file as byte-level tokens (vocab 256); sample i is the window of
    ``seq_len + 1`` bytes starting at ``i * seq_len``."""

    vocab_size = 256

    def __init__(self, path: str | Path, seq_len: int) -> None:
        self.path = Path(path)
        self.seq_len = seq_len
        if self.path.is_dir():
            raise ValueError(f"data file {self.path} is a folder; fix [data] path in the job file "
                             "to name a text file")
        if not self.path.is_file():
            raise FileNotFoundError(
                f"data file {self.path} does not exist; fix [data] path in the job file"
            )
        self._bytes = np.fromfile(self.path, dtype=np.uint8)
        if self._bytes.size < seq_len + 1:
            raise ValueError(
                f"data file {self.path} holds {self._bytes.size} bytes, fewer than one sample of "
                f"seq_len + 1 = {seq_len + 1}; use a longer file or a shorter seq_len"
            )

    def __len__(self) -> int:
        return (self._bytes.size - 1) // self.seq_len  # windows of s + 1 bytes at stride s

    def sample(self, index: int) -> torch.Tensor:
        return self.samples(np.array([index]))[0]

    def samples(self, indices: np.ndarray) -> torch.Tensor:
        if len(indices) and (indices.min() < 0 or indices.max() >= len(self)):
            raise IndexError(f"sample index outside [0, {len(self)}) of {self.path}")
        starts = np.asarray(indices, dtype=np.int64) * self.seq_len
        windows = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
        return torch.from_numpy(self._bytes[windows].astype(np.int64))


SampleSource = SyntheticTask | ByteTextFile


class DataShard:
    """The batches one data-parallel rank trains on, as a pure function of consumed_samples."""

    def __init__(self, source: SampleSource, order: SampleOrder, *, global_batch: int,
                 dp_rank: int, dp_size: int) -> None:
        dp_share_range(0, global_batch, dp_rank, dp_size)  # validates the split
        self.source = source
        self.order = order
        self.global_batch = global_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size

    def indices(self, consumed_samples: int) -> np.ndarray:
        start, stop = dp_share_range(consumed_samples, self.global_batch, self.dp_rank, self.dp_size)
        return self.order.indices(start, stop)

    def batch(self, consumed_samples: int) -> torch.Tensor:
        """LongTensor[global_batch // dp, seq_len + 1] for the step that starts at
        ``consumed_samples``."""
        return self.source.samples(self.indices(consumed_samples))


def make_source(job: JobConfig, model: ModelSpec) -> SampleSource:
    """The job's sample source, checked against the model's vocabulary."""
    if job.data.kind == "synthetic":
        return SyntheticTask(vocab_size=model.vocab_size, seq_len=job.model.seq_len,
                             seed=job.data.seed)
    path = job.data_path()
    assert path is not None  # DataSection insists on a path for text
    source = ByteTextFile(path, job.model.seq_len)
    if model.vocab_size < ByteTextFile.vocab_size:
        raise ValueError(
            f"text data is byte-level ({ByteTextFile.vocab_size} tokens) but model {model.name} has "
            f"vocab_size {model.vocab_size}; use a model with vocab_size >= 256"
        )
    return source
