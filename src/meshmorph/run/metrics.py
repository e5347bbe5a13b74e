"""Per-step metrics on rank 0: one line per step, a progress bar, ``metrics.jsonl`` and ``loss.png``."""

from __future__ import annotations

import json
import resource
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

METRICS_FILE = "metrics.jsonl"
LOSS_CHART = "loss.png"


@dataclass(frozen=True, slots=True)
class StepMetrics:
    """What one optimizer step measured."""

    step: int
    """1-based step that just finished."""
    loss: float
    """Mean loss of the global batch."""
    lr: float
    """Learning rate the step used."""
    grad_norm: float
    """Global gradient norm before clipping."""
    step_time_s: float
    """Wall time of the step."""
    tokens_per_s: float
    """Global tokens of the step / step time."""
    peak_memory_mib: float
    """Peak memory of rank 0: CUDA max allocated, or the process's peak RSS on CPU."""
    consumed_samples: int
    """Samples of the order consumed after this step."""

    def line(self, total_steps: int) -> str:
        return (f"step {self.step:>5}/{total_steps} | loss {self.loss:.4f} | lr {self.lr:.2e} | "
                f"grad {self.grad_norm:.3f} | {self.step_time_s:.3f} s | "
                f"{self.tokens_per_s:,.0f} tok/s | mem {self.peak_memory_mib:,.0f} MiB")


def peak_memory_mib() -> float:
    """CUDA max_memory_allocated when a GPU is in use, else peak RSS of this process."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def parse_line(line: str) -> dict[str, Any] | None:
    """The record of one metrics.jsonl line; None for a blank line, a line cut short when its
    run was killed, or one that holds no object."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) else None


def record_step(record: dict) -> int | None:  # type: ignore[type-arg]
    """The step a metrics.jsonl line belongs to: a step line's ``step``, a reshape event's
    ``at_step``, a state event's ``after_step``; None for a line that names none."""
    for key in ("step", "at_step", "after_step"):
        if isinstance(record.get(key), int):
            return int(record[key])
    return None


def truncate_metrics(path: Path, last_step: int) -> None:
    """Keep the lines of steps up to ``last_step`` and the events that happened by then; drop
    the rest (a resumed run writes its steps again; events of a run that went on past its
    newest checkpoint, or that name no step, are not this run's history)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        record = parse_line(line)
        step = record_step(record) if record is not None else None
        if step is not None and step <= last_step:
            kept.append(line)
    path.write_text("".join(line + "\n" for line in kept))


class MetricsLogger:
    """Rank 0 prints and records every step; other ranks hold a logger that does nothing."""

    def __init__(self, out_dir: Path, *, enabled: bool, total_steps: int, start_step: int,
                 tokens_per_step: int, console: Console | None = None) -> None:
        self.enabled = enabled
        self.total_steps = total_steps
        self.tokens_per_step = tokens_per_step
        self.path = out_dir / METRICS_FILE
        self._progress: Progress | None = None
        if not enabled:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        truncate_metrics(self.path, start_step)
        self.console = console or Console(file=sys.stdout, highlight=False, soft_wrap=True)
        self._progress = Progress(
            TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(),
            TimeRemainingColumn(), console=self.console, transient=True,
        )
        self._task = self._progress.add_task("train", total=total_steps, completed=start_step)
        self._progress.start()

    def log(self, *, step: int, loss: float, lr: float, grad_norm: float, step_time_s: float,
            consumed_samples: int) -> StepMetrics | None:
        if not self.enabled:
            return None
        metrics = StepMetrics(
            step=step, loss=loss, lr=lr, grad_norm=grad_norm, step_time_s=step_time_s,
            tokens_per_s=self.tokens_per_step / max(step_time_s, 1e-9),  # B * s / step time
            peak_memory_mib=peak_memory_mib(), consumed_samples=consumed_samples,
        )
        with self.path.open("a") as handle:
            handle.write(json.dumps(asdict(metrics)) + "\n")
        assert self._progress is not None
        self._progress.console.print(metrics.line(self.total_steps))
        self._progress.update(self._task, completed=step)
        return metrics

    def log_event(self, record: dict[str, Any]) -> None:
        """Append one non-step record (e.g. ``{"event": "state", ...}``) to metrics.jsonl."""
        if not self.enabled:
            return
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")

    def close(self) -> None:
        """Stop the progress bar (the loss chart is drawn by the launching command, cli/)."""
        if self.enabled:
            assert self._progress is not None
            self._progress.stop()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The step records of a metrics file, in order (event lines such as ``state`` left out)."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [record for record in records if "step" in record]
