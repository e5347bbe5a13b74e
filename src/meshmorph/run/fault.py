"""Test-only fault injection: SIGKILL (or pause) one rank at a precise phase of one step.

Off unless ``MESHMORPH_FAULT`` is set (tests, ``bench/fault_matrix.py``, demos)::

    MESHMORPH_FAULT=RANK@STEP:PHASE[:pause=SECONDS][,RANK@STEP:PHASE...]

PHASE says where in step STEP (1-based, the step being trained) rank RANK is hit (``*``: any
rank of the processes that have the variable, e.g. the workers of one node of a multi-node
run, whichever global ranks the rendezvous gave them):

- ``forward``: the forward of the step's second micro-batch (its first when there is only one);
- ``backward``: the backward of the step's first micro-batch (when the gradient of the first
  model part's output is computed);
- ``optimizer``: inside the optimizer step, once the first of the rank's optimizers has updated
  its parameters (the others not yet);
- ``checkpoint``: in the checkpoint saved after step STEP, once this rank's files are written to
  the ``.tmp-`` folder and before the commit;
- ``reshape``: in an ``--elastic`` restart that restores step STEP from the node stores, once
  the files are pulled and before the new engine is filled in.

The action is SIGKILL of the rank's own process, or with ``pause=SECONDS`` a sleep of that long
(a window in which a test signals the launcher mid-step or mid-save). Each fault fires once per
run folder: on firing it writes the marker ``.fault-RANK-STEP-PHASE`` (``.fault-any-...`` for
``*``; the pid) into the run folder, so the restarted or resumed run does not fire it again, and a watcher that sees the
marker knows the rank has reached the phase. ``--inject-failure RANK@STEP`` is the ``forward``
fault (marker ``.failure-injected-RANK-STEP``).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FAULT_ENV = "MESHMORPH_FAULT"
"""The environment variable that arms faults (unset: none)."""
PHASES = ("forward", "backward", "optimizer", "checkpoint", "reshape")
"""Where a fault can hit, in the order a step (and a restart) passes them."""


@dataclass(frozen=True, slots=True)
class Fault:
    """One fault: rank, step, phase and action."""

    rank: int | None
    """The global rank hit (None: any)."""
    step: int
    """The step (1-based) being trained, saved (checkpoint) or restored (reshape)."""
    phase: str
    """One of ``PHASES``."""
    pause_s: float | None = None
    """None: SIGKILL; else sleep this many seconds and go on."""
    marker_name: str = ""
    """The marker file's name ("" : ``.fault-RANK-STEP-PHASE``)."""

    def marker(self, out_dir: Path) -> Path:
        who = "any" if self.rank is None else self.rank
        return out_dir / (self.marker_name or f".fault-{who}-{self.step}-{self.phase}")


def _fault(text: str) -> Fault:
    usage = (f"{FAULT_ENV} takes RANK@STEP:PHASE[:pause=SECONDS] (RANK a number or *, PHASE one "
             f"of {', '.join(PHASES)})")
    where, _, rest = text.strip().partition(":")
    phase, _, action = rest.partition(":")
    rank, at, step = where.partition("@")
    if not at or not (rank.isdigit() or rank == "*") or not step.isdigit() or int(step) < 1:
        raise ValueError(f"{usage}, step >= 1; got {text!r}")
    if phase not in PHASES:
        raise ValueError(f"{usage}; got phase {phase!r} in {text!r}")
    pause_s = None
    if action:
        key, _, value = action.partition("=")
        try:
            pause_s = float(value) if key == "pause" else -1.0
        except ValueError:
            pause_s = -1.0
        if not 0 <= pause_s < float("inf"):
            raise ValueError(f"{usage}; the action must be pause=SECONDS >= 0, got {action!r}")
    return Fault(None if rank == "*" else int(rank), int(step), phase, pause_s)


def parse_faults(text: str | None) -> list[Fault]:
    """The faults a ``MESHMORPH_FAULT`` value arms (comma-separated); None or "": none."""
    if not text or not text.strip():
        return []
    return [_fault(part) for part in text.split(",") if part.strip()]


_armed: list[Fault] = []
_out_dir: Path | None = None


def install(out_dir: Path, extra: list[Fault] | None = None) -> list[Fault]:
    """Arm the faults of ``MESHMORPH_FAULT`` (and ``extra``) for this process's run folder;
    returns them."""
    global _out_dir
    _armed[:] = [*parse_faults(os.environ.get(FAULT_ENV)), *(extra or [])]
    _out_dir = out_dir
    return list(_armed)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def _due(phase: str, step: int) -> list[Fault]:
    """The armed faults of this rank at ``phase`` of ``step`` that have not fired yet."""
    if not _armed or _out_dir is None:
        return []
    rank = _rank()
    return [f for f in _armed if f.rank in (None, rank) and (f.step, f.phase) == (step, phase)
            and not f.marker(_out_dir).exists()]


def fire(fault: Fault) -> None:
    """Write the fault's marker, then SIGKILL this process or pause."""
    assert _out_dir is not None
    fault.marker(_out_dir).write_text(str(os.getpid()))
    where = "in step" if fault.phase == "forward" else f"in the {fault.phase} of step"
    rank = _rank()
    if fault.pause_s is not None:
        print(f"meshmorph: injected pause: rank {rank} (pid {os.getpid()}) sleeps "
              f"{fault.pause_s:g} s {where} {fault.step}", file=sys.stderr, flush=True)
        time.sleep(fault.pause_s)
        return
    print(f"meshmorph: injected failure: SIGKILL rank {rank} (pid {os.getpid()}) {where} "
          f"{fault.step}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def point(phase: str, step: int) -> None:
    """Fire the faults due at ``phase`` of ``step`` on this rank (``checkpoint``, ``reshape``)."""
    for fault in _due(phase, step):
        fire(fault)


def arm_step(engine: Any, step: int) -> None:
    """Hook the ``forward``, ``backward`` and ``optimizer`` faults of ``step`` on this rank into
    the engine for this step (the hooks remove themselves once they fired)."""
    for fault in _due("forward", step) + _due("backward", step) + _due("optimizer", step):
        if fault.phase == "forward":
            _on_forward(engine, fault, 2 if engine.plan.num_microbatches > 1 else 1)
        elif fault.phase == "backward":
            _on_forward(engine, fault, 1, backward=True)
        else:
            _on_optimizer(engine, fault)


def _once(fault: Fault, handles: list[Any]) -> Callable[[], None]:
    def go() -> None:
        for handle in handles:
            handle.remove()
        if _out_dir is not None and not fault.marker(_out_dir).exists():
            fire(fault)
    return go


def _on_forward(engine: Any, fault: Fault, call: int, *, backward: bool = False) -> None:
    handles: list[Any] = []
    go, calls = _once(fault, handles), {"n": 0}

    def hook(module: Any, args: Any, output: Any) -> None:
        calls["n"] += 1
        if calls["n"] != call:
            return
        if not backward:
            go()
            return
        import torch

        out = output[0] if isinstance(output, tuple) else output
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad: go())
        else:
            go()

    part = engine.model_parts[0]
    if backward:  # the first block's output: its gradient comes late in the backward
        blocks = getattr(part, "blocks", None)
        first = next(iter(blocks.values()), part) if blocks is not None else part
        handles.append(first.register_forward_hook(hook))
    else:
        handles.append(part.register_forward_pre_hook(lambda module, args: hook(module, args,
                                                                                None)))


def _on_optimizer(engine: Any, fault: Fault) -> None:
    handles: list[Any] = []
    handles.append(engine.optimizers[0].register_step_post_hook(
        lambda optimizer, args, kwargs: _once(fault, handles)()))
