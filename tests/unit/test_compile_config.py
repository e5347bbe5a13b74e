"""``[train] compile``: the job keys, and the backend chosen on a machine with or without a C++
compiler."""

from __future__ import annotations

import pytest
import torch

from meshmorph.run.job import parse_job
from meshmorph.run.parallel import compile as run_compile

BASE = {"model": {"source": "gpt-tiny", "seq_len": 16}, "train": {"steps": 1, "global_batch": 2}}


def test_compile_is_off_unless_asked_and_takes_a_backend() -> None:
    assert parse_job(BASE).train.compile is False
    job = parse_job({**BASE, "train": {**BASE["train"], "compile": True,
                                       "compile_backend": "aot_eager"}})
    assert job.train.compile is True and job.train.compile_backend == "aot_eager"


@pytest.mark.parametrize("train, message", [
    ({"compile": "yes"}, "compile must be"),
    ({"compile_backend": "tensorrt"}, "compile_backend must be inductor, aot_eager or eager"),
])
def test_bad_compile_keys_are_named(train: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_job({**BASE, "train": {**BASE["train"], **train}}, source="job.toml")


def test_inductor_without_a_cpp_compiler_falls_back_to_aot_eager(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(run_compile.shutil, "which", lambda name: None)
    choice = run_compile.resolve_backend("inductor", torch.device("cpu"))
    assert choice.backend == "aot_eager"
    assert choice.note is not None and "no C++ compiler" in choice.note


def test_inductor_with_a_cpp_compiler_stays_inductor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(run_compile.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert run_compile.resolve_backend("inductor", torch.device("cpu")) == \
        run_compile.CompileChoice("inductor", None)
    assert run_compile.resolve_backend("eager", torch.device("cpu")).note is None


def test_async_tp_needs_inductor_and_turns_its_micro_pipeline_pass_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """tp_comm_overlap is inductor's micro-pipelined TP pass: another backend is refused,
    naming the way out; compiling the blocks with it sets the pass on before any compiles."""
    from torch._inductor import config as inductor_config

    with pytest.raises(ValueError, match='compile_backend = "inductor"'):
        run_compile.resolve_backend("aot_eager", torch.device("cuda"), async_tp=True)
    assert run_compile.resolve_backend("inductor", torch.device("cuda"), async_tp=True) == \
        run_compile.CompileChoice("inductor", None)
    monkeypatch.setattr(inductor_config, "_micro_pipeline_tp", False)
    part = torch.nn.Module()
    part.blocks = torch.nn.ModuleDict({"0": torch.nn.Linear(2, 2)})
    assert run_compile.compile_blocks([part], "eager") == 1
    assert inductor_config._micro_pipeline_tp is False
    assert run_compile.compile_blocks([part], "eager", async_tp=True) == 1
    assert inductor_config._micro_pipeline_tp is True
