"""Job files for ``meshmorph run``: the gpt-tiny job every CLI test starts from, and the example
job of ``examples/jobs/text-file.toml`` with its edits.

``gpt_tiny_job`` writes the sections in a fixed order (model, data, train, optim, checkpoint,
run) and one ``key = value`` line per entry, so a test may still edit the text it returns with
``str.replace`` (``"steps = 4"``, ``'kind = "synthetic"'``, ``"lr = 0.001"``...).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
"""The repository's examples folder (job files, plans, data)."""
TEXT_FILE_JOB = EXAMPLES / "jobs" / "text-file.toml"
"""The committed example job: gpt-tiny learning examples/data/tiny.txt, 60 steps on 2 ranks."""


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, int | float):
        return repr(value)
    raise TypeError(f"no TOML rendering for {value!r}")


def toml_text(sections: dict[str, dict[str, Any]]) -> str:
    """``[section]`` and ``key = value`` lines, in the order given; empty sections left out."""
    lines = [""]
    for name, entries in sections.items():
        if not entries:
            continue
        lines.append(f"[{name}]")
        lines += [f"{key} = {_value(value)}" for key, value in entries.items()]
    return "\n".join(lines) + "\n"


def gpt_tiny_job(*, steps: int = 8, seq_len: int = 32, global_batch: int = 8,
                 micro_batch: int = 2, model: str = "gpt-tiny",
                 data: dict[str, Any] | None = None, train: dict[str, Any] | None = None,
                 optim: dict[str, Any] | None = None, checkpoint: dict[str, Any] | None = None,
                 run: dict[str, Any] | None = None) -> str:
    """The text of a job training ``model`` (gpt-tiny) on the synthetic task (data seed 1).

    ``data``, ``train``, ``optim``, ``checkpoint`` and ``run`` add keys to their sections (and
    replace the defaults of ``data`` and ``train``); a section left empty is not written."""
    return toml_text({
        "model": {"source": model, "seq_len": seq_len},
        "data": {"kind": "synthetic", "seed": 1, **(data or {})},
        "train": {"steps": steps, "global_batch": global_batch, "micro_batch": micro_batch,
                  **(train or {})},
        "optim": dict(optim or {}),
        "checkpoint": dict(checkpoint or {}),
        "run": dict(run or {}),
    })


def write_job(folder: Path, text: str, name: str = "job.toml") -> Path:
    """``text`` written to ``folder/name``; the path."""
    path = folder / name
    path.write_text(text)
    return path


def text_file_job(*, steps: int | None = None, every: int | None = None,
                  run: str | None = None) -> str:
    """The committed example job with its data path made absolute (the file may be written
    anywhere), and optionally another number of ``steps`` (the LR decay too: ``decay_steps``
    follows), checkpoint ``every`` and lines added to its ``[run]`` section. Every edit must apply
    once: an example whose text changed fails here rather than silently training something
    else."""
    text = TEXT_FILE_JOB.read_text()
    edits = [('"../data/tiny.txt"', f'"{EXAMPLES / "data" / "tiny.txt"}"')]
    if steps is not None:
        edits += [("\nsteps = 60\n", f"\nsteps = {steps}\n"),
                  ("\ndecay_steps = 60\n", f"\ndecay_steps = {steps}\n")]
    if every is not None:
        edits.append(("\nevery = 30\n", f"\nevery = {every}\n"))
    if run is not None:
        edits.append(("\n[run]\n", f"\n[run]\n{run}\n"))
    for old, new in edits:
        assert text.count(old) == 1, f"{TEXT_FILE_JOB.name}: expected one {old!r}"
        text = text.replace(old, new)
    return text


ELASTIC_STEPS, ELASTIC_GLOBAL_BATCH = 6, 8
"""Steps and global batch of ``elastic_job``."""


def elastic_job(folder: Path) -> tuple[Path, Path]:
    """The elastic tests' job and plan, written to ``folder``: a 6-step gpt-tiny job on the
    example text file (no checkpoints, collectives time out after 60 s) and a ZeRO-3 plan over
    4 ranks. (job file, plan file)."""
    from meshmorph.spec.catalog import load_model
    from meshmorph.spec.plan import Plan

    job = write_job(folder, text_file_job(steps=ELASTIC_STEPS, every=0,
                                          run="collective_timeout_s = 60"))
    plan = Plan(model="gpt-tiny", seq_len=32, global_batch=ELASTIC_GLOBAL_BATCH, dp=4, zero=3,
                micro_batch=2, num_microbatches=1, dtype="fp32")
    plan_path = folder / "zero3.json"
    plan_path.write_text(plan.with_even_stages(load_model("gpt-tiny", 32)).to_json())
    return job, plan_path
