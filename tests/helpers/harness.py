"""The spawn-and-compare harness of the equivalence tests: each rank trains a layout and reports
(``train_and_report``), one layout after another in one process group (``each_case``); the test
then reads what the ranks reported (``reported_run``) and compares it with the one-device oracle
(``oracle.py``), or the ranks' measured state with the cost model's prediction
(``state_gaps``)."""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from meshmorph.run.config import OptimConfig
from meshmorph.spec.model import ModelSpec
from meshmorph.spec.plan import Plan
from tests.helpers.reference import ReferenceRun
from tests.helpers.world import collect


def each_case(rank: int, out: Path, cases: Iterable[tuple[str, Callable[[Path], None]]]) -> None:
    """Run every ``(name, run)`` in turn as ``run(out / name)`` on this rank, a barrier after
    each; a case that raises leaves ``error<rank>.txt`` in its folder and the next one runs."""
    import torch.distributed as dist

    for name, run in cases:
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        try:
            run(folder)
        except Exception:
            (folder / f"error{rank}.txt").write_text(traceback.format_exc())
            print(f"rank {rank} case {name} failed:\n{traceback.format_exc()}", flush=True)
        collect()
        dist.barrier()


def full_params(engine: Any) -> dict[str, torch.Tensor]:
    """Every parameter of every chunk this rank holds, whole (DTensors gathered), by its name in
    the one-device model (a tied matrix under both names)."""
    from torch.distributed.tensor import DTensor

    params = {}
    for part in engine.model_parts:
        for name, param in part.named_parameters(remove_duplicate=False):
            full = param.full_tensor() if isinstance(param, DTensor) else param
            params[name] = full.detach().clone()
    return params


def train_and_report(engine: Any, plan: Plan, batches: list[torch.Tensor], out: Path,
                     rank: int, *, state: bool = False,
                     before_step: Callable[[int], None] | None = None) -> None:
    """Train ``engine`` one step per global batch (this rank's data-parallel share of it); write
    the losses, gradient norms and step times to ``rank<rank>.json`` (with the measured state of
    the first step where ``state``) and, on the first rank of each pipeline stage, the final
    parameters to ``params_pp<stage>.pt``. ``before_step(i)`` runs before step i."""
    import time

    share = plan.global_batch // plan.dp
    losses, norms, times = [], [], []
    for index, batch in enumerate(batches):
        if before_step is not None:
            before_step(index)
        start = time.perf_counter()
        losses.append(engine.step(batch[engine.dp_rank * share:(engine.dp_rank + 1) * share]))
        times.append(time.perf_counter() - start)
        norms.append(engine.grad_norm_last())
    params = full_params(engine)
    mesh = engine.train_mesh
    if mesh.dp_rank == 0 and mesh.tp_rank == 0:
        torch.save(params, out / f"params_pp{mesh.pp_rank}.pt")
    report: dict[str, Any] = {"losses": losses, "grad_norms": norms, "step_s": times}
    if state:
        from meshmorph.run.engine import state_line

        report["state"] = state_line.measured_state(engine)
    (out / f"rank{rank}.json").write_text(json.dumps(report))


def build_and_train(model: ModelSpec, plan: Plan, optim: OptimConfig, seed: int,
                    batches: list[torch.Tensor], out: Path, rank: int, *,
                    state: bool = False) -> Any:
    """``build_engine`` on the CPU, then ``train_and_report``; the engine."""
    from meshmorph.run.engine.train_engine import build_engine

    engine = build_engine(model, plan, optim, seed=seed, device=torch.device("cpu"))
    train_and_report(engine, plan, batches, out, rank, state=state)
    return engine


def rank_reports(out: Path, world: int) -> list[dict]:
    """Every rank's ``rank<r>.json``, after checking that no rank failed."""
    errors = sorted(out.glob("error*.txt"))
    assert not errors, "\n".join(e.read_text() for e in errors)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def reported_run(out: Path, world: int, steps: int | None = None) -> ReferenceRun:
    """What the ranks of one layout reported, after checking they agree on losses and norms:
    rank 0's losses and gradient norms and the parameters of every pipeline stage."""
    reports = rank_reports(out, world)
    for rank, report in enumerate(reports):  # every rank returns the same loss and norm
        assert report["losses"] == reports[0]["losses"], f"rank {rank} reports other losses"
        assert report["grad_norms"] == reports[0]["grad_norms"], f"rank {rank}: other norms"
    if steps is not None:
        assert len(reports[0]["losses"]) == steps
    params: dict[str, torch.Tensor] = {}
    for path in sorted(out.glob("params_pp*.pt")):
        params.update(torch.load(path))
    return ReferenceRun(tuple(reports[0]["losses"]), tuple(reports[0]["grad_norms"]), params)


def state_pairs(measured: dict, predicted: dict) -> list[tuple[str, float, float]]:
    """(figure, measured, predicted) of a rank's state: the three byte counts, the peak between
    micro-batches where either side has it (pp 1), then the bytes of every kind of collective
    either side names (0 where the other does not)."""
    pairs = [(key, measured[key], predicted[key])
             for key in ("params_bytes", "grads_bytes", "optimizer_bytes")]
    if "peak_state_bytes" in measured or "peak_state_bytes" in predicted:
        pairs.append(("peak_state_bytes", measured.get("peak_state_bytes", 0),
                      predicted.get("peak_state_bytes", 0)))
    kinds = sorted(set(predicted["comm_bytes"]) | set(measured["comm_bytes"]))
    pairs += [(f"comm_bytes.{kind}", measured["comm_bytes"].get(kind, 0),
               predicted["comm_bytes"].get(kind, 0)) for kind in kinds]
    return pairs


def state_gaps(ranks: Iterable[tuple[int, dict, dict]], tolerance: float) -> list[str]:
    """Every figure of ``(rank, measured, predicted)`` whose measured value is off the predicted
    one by more than ``tolerance`` x max(|predicted|, 1) (0: exactly equal)."""
    gaps = []
    for rank, measured, predicted in ranks:
        for key, got, want in state_pairs(measured, predicted):
            if abs(got - want) > tolerance * max(abs(want), 1):
                gaps.append(f"rank {rank} {key}: measured {got:,.0f}, predicted {want:,.0f}")
    return gaps
