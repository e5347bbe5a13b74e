"""Job files: every section read into its dataclass, every mistake named with key and file."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshmorph.run.config import OptimConfig
from meshmorph.run.job import load_job
from tests.helpers.jobs import gpt_tiny_job

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "jobs"

FULL = gpt_tiny_job(steps=12, data={"kind": "text", "path": "data/t.txt", "seed": 4},
                    train={"seed": 3}, optim={"lr": 1e-3, "min_lr": 0, "warmup_steps": 2},
                    checkpoint={"every": 5, "keep": 3, "dir": "ckpt"}, run={"out_dir": "runs/x"})


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def test_full_job_file_reads_every_field(tmp_path: Path) -> None:
    job = load_job(_write(tmp_path, FULL))
    assert (job.model.source, job.model.seq_len) == ("gpt-tiny", 32)
    assert (job.data.kind, job.data.seed) == ("text", 4)
    assert job.data_path() == tmp_path / "data" / "t.txt"  # relative to the job file
    assert (job.train.steps, job.train.global_batch, job.train.micro_batch, job.train.seed) == (
        12, 8, 2, 3)
    assert job.optim == OptimConfig(lr=1e-3, min_lr=0.0, warmup_steps=2)
    assert isinstance(job.optim.min_lr, float)
    assert (job.checkpoint.every, job.checkpoint.keep) == (5, 3)
    assert job.checkpoint_dir() == Path("runs/x/ckpt")
    assert job.checkpoint_dir(Path("elsewhere")) == Path("elsewhere/ckpt")


def test_minimal_job_file_takes_defaults(tmp_path: Path) -> None:
    job = load_job(_write(tmp_path, '[model]\nsource = "gpt-tiny"\nseq_len = 16\n'
                                    "[train]\nsteps = 3\nglobal_batch = 4\n"))
    assert job.data.kind == "synthetic" and job.data_path() is None
    assert (job.train.micro_batch, job.train.dtype, job.checkpoint.every) == (1, "fp32", 0)
    assert job.optim == OptimConfig()


@pytest.mark.parametrize(("edit", "message"), [
    (("seq_len = 32", "seq_len = 32\nsequence = 3"),
     r"job\.toml: unknown key 'sequence' in \[model\]; known keys: source, seq_len"),
    (("[run]", "[runs]"), r"job\.toml: unknown section \[runs\]"),
    (("steps = 12", 'steps = "12"'), r"job\.toml: \[train\] steps must be int, got '12'"),
    (("steps = 12", "steps = 12.5"), r"\[train\] steps must be int, got 12\.5"),
    (("every = 5", "every = true"), r"\[checkpoint\] every must be int, got True"),
    (("lr = 0.001", 'lr = "fast"'), r"\[optim\] lr must be float, got 'fast'"),
    (('kind = "text"', 'kind = "images"'), r"\[data\] kind must be 'synthetic' or 'text'"),
    (("micro_batch = 2", "micro_batch = 3"), r"micro_batch 3 does not divide global_batch 8"),
    (("lr = 0.001", "lr = -1.0"), r"job\.toml: \[optim\] needs 0 <= min_lr <= lr"),
    (("[model]", "model = 3\n[models]"), r"unknown section \[models\]"),
])
def test_mistakes_are_refused_naming_file_and_key(tmp_path: Path, edit: tuple[str, str],
                                                  message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_job(_write(tmp_path, FULL.replace(*edit, 1)))


def test_missing_section_key_or_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"job\.toml: missing section \[train\]"):
        load_job(_write(tmp_path, '[model]\nsource = "gpt-tiny"\nseq_len = 16\n'))
    with pytest.raises(ValueError, match=r"\[train\] is incomplete: .*global_batch"):
        load_job(_write(tmp_path, '[model]\nsource = "a"\nseq_len = 16\n[train]\nsteps = 1\n'))
    with pytest.raises(ValueError, match=r"job file .*job\.toml is not valid TOML: .*examples/jobs/"):
        load_job(_write(tmp_path, "[model\n"))
    with pytest.raises(FileNotFoundError, match=r"job file .*absent\.toml does not exist"):
        load_job(tmp_path / "absent.toml")


@pytest.mark.parametrize("name", ["gpt-small-synthetic.toml", "text-file.toml"])
def test_example_job_files_load_and_their_data_exists(name: str) -> None:
    job = load_job(EXAMPLES / name)
    path = job.data_path()
    assert path is None or path.is_file()
    assert job.train.global_batch % job.train.micro_batch == 0


def test_demo_job_is_a_valid_job_file(tmp_path: Path) -> None:
    from meshmorph.cli.demo import _JOB, DEMO_GLOBAL_BATCH, DEMO_MODEL

    path = _write(tmp_path, _JOB.format(model=DEMO_MODEL, seq_len=64, steps=50,
                                        global_batch=DEMO_GLOBAL_BATCH, out_dir="runs/demo"))
    job = load_job(path)
    assert (job.model.source, job.train.steps, job.optim.decay_steps) == ("gpt-small", 50, 50)
    assert job.checkpoint.every == 0 and job.out_dir() == Path("runs/demo")


def test_min_lr_defaults_to_a_tenth_of_lr_so_a_small_lr_is_accepted() -> None:
    assert OptimConfig().min_lr == 3e-4  # lr 3e-3
    assert OptimConfig(lr=1e-4).min_lr == 1e-5
    with pytest.raises(ValueError, match=r"set min_lr at most lr, or leave it out \(lr / 10\)"):
        OptimConfig(lr=1e-4, min_lr=3e-4)
