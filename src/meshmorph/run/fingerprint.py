"""What a checkpoint belongs to: the model, the data and the plan of the run that saved it.

A checkpoint's manifest stores a fingerprint; ``--resume`` compares it with the job it is asked to
continue, so a checkpoint is never loaded into another model or continued on other data, and a
checkpoint of another plan is loaded (resharded by DCP) only when ``--reshard`` asks for it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from meshmorph.run.job import JobConfig
from meshmorph.spec.model import ModelSpec
from meshmorph.spec.plan import Plan


@dataclass(frozen=True, slots=True, kw_only=True)
class RunFingerprint:
    """The identity of a training run, as stored in each checkpoint manifest."""

    model: dict[str, Any]
    """Model source, sequence length and shape (vocabulary, width, depth, heads, tying)."""
    data: dict[str, Any]
    """Data kind, seed, and for a text file its resolved path and size in bytes."""
    plan_sha256: str
    """SHA-256 of the plan's JSON (sorted keys, predicted figures left out)."""
    plan_layout: str
    """The plan in words (``tp 1 x pp 2 x dp 1, zero 0``), for messages."""

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "data": self.data, "plan_sha256": self.plan_sha256,
                "plan_layout": self.plan_layout}

    @classmethod
    def from_dict(cls, data: Any) -> RunFingerprint | None:
        """The stored fingerprint, or None when the manifest holds none or a malformed one."""
        if not isinstance(data, dict):
            return None
        try:
            return cls(model=dict(data["model"]), data=dict(data["data"]),
                       plan_sha256=str(data["plan_sha256"]), plan_layout=str(data["plan_layout"]))
        except (KeyError, TypeError, ValueError):
            return None


def plan_layout(plan: Plan) -> str:
    """A plan's degrees in one phrase."""
    return (f"tp {plan.tp} x pp {plan.pp} x dp {plan.dp}, zero {plan.zero}, "
            f"micro-batch {plan.micro_batch} x {plan.num_microbatches}, {plan.schedule}")


def plan_sha256(plan: Plan) -> str:
    data = {key: value for key, value in plan.to_dict().items() if key != "predicted"}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def run_fingerprint(job: JobConfig, model: ModelSpec, plan: Plan) -> RunFingerprint:
    """The fingerprint of a job run under ``plan``."""
    model_part = {
        "source": job.model.source, "seq_len": job.model.seq_len, "arch": model.arch,
        "vocab_size": model.vocab_size, "hidden_size": model.hidden_size,
        "num_blocks": model.num_blocks, "num_heads": model.num_heads,
        "num_kv_heads": model.num_kv_heads, "ffn_hidden_size": model.ffn_hidden_size,
        "tied_embeddings": model.tied_embeddings,
    }
    data_part: dict[str, Any] = {"kind": job.data.kind, "seed": job.data.seed}
    path = job.data_path()
    if path is not None:
        resolved = path.resolve()
        data_part["path"] = str(resolved)
        data_part["bytes"] = resolved.stat().st_size if resolved.is_file() else None
    return RunFingerprint(model=model_part, data=data_part, plan_sha256=plan_sha256(plan),
                          plan_layout=plan_layout(plan))


def _differences(saved: dict[str, Any], wanted: dict[str, Any]) -> str:
    keys = sorted(set(saved) | set(wanted))
    return ", ".join(f"{key} {saved.get(key)!r} -> {wanted.get(key)!r}" for key in keys
                     if saved.get(key) != wanted.get(key))


def check_resume(saved: RunFingerprint | None, wanted: RunFingerprint, *, where: str,
                 reshard: bool) -> bool:
    """Refuse to continue a checkpoint of another model or data, or of another plan without
    ``reshard``; returns whether the plan differs (a reshard on load)."""
    way_out = "resume with the job file that saved it, or start without --resume in a new folder (--out)"
    if saved is None:
        raise ValueError(
            f"checkpoint {where} has no run fingerprint in its manifest, so meshmorph cannot "
            f"tell which model, data and plan saved it; {way_out}"
        )
    if saved.model != wanted.model:
        raise ValueError(
            f"checkpoint {where} was saved by another model ({_differences(saved.model, wanted.model)}); "
            f"{way_out}"
        )
    if saved.data != wanted.data:
        raise ValueError(
            f"checkpoint {where} was saved on other data ({_differences(saved.data, wanted.data)}); "
            f"{way_out}"
        )
    if saved.plan_sha256 == wanted.plan_sha256:
        return False
    if not reshard:
        raise ValueError(
            f"checkpoint {where} was saved under another plan ({saved.plan_layout}) than this "
            f"run's ({wanted.plan_layout}); pass --reshard to load it into the new plan (DCP "
            f"reshards on load), or resume with the plan that saved it (--plan RUN_FOLDER/plan.json)"
        )
    return True
