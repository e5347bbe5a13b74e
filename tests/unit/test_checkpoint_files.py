"""Checkpoint folders: atomic commit, manifest verification, newest-checkpoint search,
retention, the tied-head key mapping, and a single-process DCP save/load round trip."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from meshmorph.run.checkpoint import (
    MANIFEST,
    CheckpointError,
    commit_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    remove_interrupted_saves,
    save_checkpoint,
    scan_checkpoints,
    tied_aliases,
    verify_checkpoint,
)

PLAN = {"model": "gpt-tiny", "dp": 2, "world_size": 2}


def _fake_save(ckpt_dir: Path, step: int, payload: bytes = b"x" * 100) -> Path:
    tmp = ckpt_dir / f"step-{step}.tmp-abc{step}"
    tmp.mkdir(parents=True)
    (tmp / "__0_0.distcp").write_bytes(payload)
    (tmp / ".metadata").write_bytes(b"meta")
    final = ckpt_dir / f"step-{step}"
    commit_checkpoint(tmp, final, step=step, consumed_samples=8 * step, plan=PLAN)
    return final


def test_commit_writes_manifest_with_sizes_and_renames(tmp_path: Path) -> None:
    final = _fake_save(tmp_path, 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-4"]
    marker = json.loads((final / MANIFEST).read_text())
    assert (marker["step"], marker["consumed_samples"], marker["plan"]) == (4, 32, PLAN)
    assert {k: v["bytes"] for k, v in marker["files"].items()} == {".metadata": 4, "__0_0.distcp": 100}
    info = verify_checkpoint(final)
    assert (info.step, info.consumed_samples, info.path) == (4, 32, final)


def test_latest_ignores_interrupted_saves_and_warns(tmp_path: Path) -> None:
    _fake_save(tmp_path, 2)
    _fake_save(tmp_path, 10)  # numeric, not lexical, order: 10 is newer than 2 and 9
    (tmp_path / "step-12.tmp-dead").mkdir()
    _fake_save(tmp_path, 9)
    warned: list[str] = []
    info = latest_checkpoint(tmp_path, warn=warned.append)
    assert info is not None and info.step == 10
    assert len(warned) == 1 and "step-12.tmp-dead" in warned[0]
    complete, ignored = scan_checkpoints(tmp_path)
    assert [p.name for p in complete] == ["step-2", "step-9", "step-10"]
    assert [p.name for p in ignored] == ["step-12.tmp-dead"]
    assert latest_checkpoint(tmp_path / "none") is None


def test_a_save_cut_short_after_its_manifest_but_before_its_rename_is_never_loaded(
        tmp_path: Path) -> None:
    _fake_save(tmp_path, 4)
    cut = _fake_save(tmp_path, 6).rename(tmp_path / "step-6.tmp-abc6")  # manifest inside, not renamed
    assert (cut / MANIFEST).is_file()
    warned: list[str] = []
    info = latest_checkpoint(tmp_path, warn=warned.append)
    assert info is not None and info.step == 4
    assert warned == [f"ignoring {cut}: not a committed checkpoint (left by an interrupted save)"]


def test_newest_checkpoint_without_manifest_is_refused_naming_the_previous_one(
        tmp_path: Path) -> None:
    _fake_save(tmp_path, 4)
    (_fake_save(tmp_path, 8) / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match=r"step-8 is incomplete: manifest\.json is missing"
                       r".*the previous checkpoint is .*step-4"):
        latest_checkpoint(tmp_path)


def test_manifest_is_written_last_with_reported_hashes_and_fingerprint(tmp_path: Path) -> None:
    tmp = tmp_path / "step-3.tmp-x"
    tmp.mkdir()
    (tmp / "__0_0.distcp").write_bytes(b"a" * 7)
    (tmp / "__1_0.distcp").write_bytes(b"b" * 5)
    reported = {"__1_0.distcp": {"bytes": 5, "sha256": hashlib.sha256(b"b" * 5).hexdigest()}}
    commit_checkpoint(tmp, tmp_path / "step-3", step=3, consumed_samples=24, plan=PLAN,
                      files=reported, fingerprint={"plan_sha256": "abc"})
    manifest = json.loads((tmp_path / "step-3" / MANIFEST).read_text())
    assert manifest["files"]["__1_0.distcp"] == reported["__1_0.distcp"]
    assert manifest["files"]["__0_0.distcp"]["sha256"] == hashlib.sha256(b"a" * 7).hexdigest()
    assert manifest["fingerprint"] == {"plan_sha256": "abc"}
    assert not list(tmp_path.glob("*.tmp-*")) and not list(tmp_path.rglob("*.partial"))


def test_a_reported_file_that_is_not_there_is_never_committed(tmp_path: Path) -> None:
    tmp = tmp_path / "step-3.tmp-x"
    tmp.mkdir()
    (tmp / "__0_0.distcp").write_bytes(b"a")
    with pytest.raises(CheckpointError, match=r"a rank reported __1_0\.distcp"):
        commit_checkpoint(tmp, tmp_path / "step-3", step=3, consumed_samples=24, plan=PLAN,
                          files={"__1_0.distcp": {"bytes": 1, "sha256": "0"}})
    assert not (tmp_path / "step-3").exists() and not (tmp / MANIFEST).exists()


def test_pipeline_head_reads_the_tied_embedding_of_a_checkpoint_without_pipeline() -> None:
    saved = {"optim.state.embed.tok.weight.exp_avg", "optim.state.embed.tok.weight.step",
             "model.head.out.weight", "model.embed.tok.weight"}
    keys = ["state.head.out.weight.exp_avg", "state.head.out.weight.step", "state.head.norm.weight.step"]
    assert tied_aliases("optim", keys, saved) == {
        "state.head.out.weight.exp_avg": "state.embed.tok.weight.exp_avg",
        "state.head.out.weight.step": "state.embed.tok.weight.step"}
    assert tied_aliases("model", ["head.out.weight"], saved) == {}  # saved under its own name
    # a rank that holds both (no pipeline) reads the embedding under its own name
    assert tied_aliases("optim", [*keys, "state.embed.tok.weight.step"], saved) == {
        "state.head.out.weight.exp_avg": "state.embed.tok.weight.exp_avg"}


@pytest.mark.parametrize(("damage", "message"), [
    (lambda f: f.unlink(), r"file __0_0\.distcp is missing"),
    (lambda f: f.write_bytes(b"x" * 60), r"__0_0\.distcp has 60 bytes, the manifest says 100"),
    (lambda f: f.write_bytes(b"y" * 100), r"__0_0\.distcp does not match its SHA-256"),
])
def test_corrupted_newest_checkpoint_names_folder_and_previous_one(tmp_path: Path, damage,
                                                                   message: str) -> None:
    _fake_save(tmp_path, 4)
    newest = _fake_save(tmp_path, 8)
    damage(newest / "__0_0.distcp")
    with pytest.raises(CheckpointError, match=message) as caught:
        latest_checkpoint(tmp_path)
    text = str(caught.value)
    assert str(newest) in text and str(tmp_path / "step-4") in text
    assert verify_checkpoint(tmp_path / "step-4").step == 4  # the good one is untouched


def test_unreadable_manifest_is_a_clear_error(tmp_path: Path) -> None:
    final = _fake_save(tmp_path, 3)
    (final / MANIFEST).write_text("{not json")
    with pytest.raises(CheckpointError, match=r"step-3 has an unreadable manifest\.json"):
        verify_checkpoint(final)


def test_prune_keeps_the_newest_complete_checkpoints(tmp_path: Path) -> None:
    for step in (5, 10, 15, 20):
        _fake_save(tmp_path, step)
    (tmp_path / "step-25.tmp-x").mkdir()
    deleted = prune_checkpoints(tmp_path, keep=2)
    assert [p.name for p in deleted] == ["step-5", "step-10"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-15", "step-20", "step-25.tmp-x"]


def test_saving_a_step_again_replaces_the_old_folder(tmp_path: Path) -> None:
    _fake_save(tmp_path, 6, payload=b"a" * 10)
    _fake_save(tmp_path, 6, payload=b"b" * 20)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-6"]
    assert (tmp_path / "step-6" / "__0_0.distcp").read_bytes() == b"b" * 20


def _engine(seed: int) -> SimpleNamespace:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    return SimpleNamespace(model_parts=[model], optimizers=[opt], lr_schedulers=[sched])


def _train(engine: SimpleNamespace, steps: int) -> list[float]:
    losses = []
    for step in range(steps):
        x = torch.arange(8.0).reshape(2, 4) / (step + 1)
        loss = engine.model_parts[0](x).square().mean()
        loss.backward()
        engine.optimizers[0].step()
        engine.lr_schedulers[0].step()
        engine.optimizers[0].zero_grad()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_single_process_save_then_load_continues_bitwise(tmp_path: Path) -> None:
    original = _engine(0)
    _train(original, 3)
    path = save_checkpoint(original, tmp_path, step=3, consumed_samples=24,
                           plan={"world_size": 1}, keep=2)
    torch.manual_seed(123)
    expected = _train(original, 3) + [float(torch.rand(()))]
    restored = _engine(1)  # other weights, no optimizer state, other RNG
    load_checkpoint(restored, verify_checkpoint(path))
    assert restored.lr_schedulers[0].last_epoch == 3
    torch.manual_seed(123)
    assert _train(restored, 3) + [float(torch.rand(()))] == expected


def test_a_committed_save_removes_the_tmp_folders_of_interrupted_ones(tmp_path: Path) -> None:
    _fake_save(tmp_path, 4)
    for name in ("step-6.tmp-dead", "step-2.tmp-x"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__1_0.distcp").write_bytes(b"half")
    removed = remove_interrupted_saves(tmp_path)
    assert [p.name for p in removed] == ["step-2.tmp-x", "step-6.tmp-dead"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-4"]
