"""Reshaping a running job in memory trains to the numbers of one device.

One spawned 4-process gloo job (fp32, gpt-tiny, global batch 8) trains one step under each plan
of a chain and reshapes in memory between them (``elastic/live/controller.py``: the MovePlan's
transfers point to point, the new engine built on the meta device and filled from the pieces):

    dp4 -> dp2 (processes 0 and 1 leave, planned) -> ZeRO-3 dp4 (0 and 1 join) -> tp2 x pp2
    -> tp2 x dp2 -> pp2 x dp2 -> pp2 x tp2 -> ZeRO-3 dp4

so every scenario of the reshape matrix is one move of it (dp4 -> dp2, dp2 -> dp4, tp2xdp2 ->
pp2xdp2, pp2xtp2 -> ZeRO-3 over 4, ZeRO-3 dp4 -> tp2xpp2). Checked here: per move, the per-tensor
hashes of the whole state (parameters, both AdamW moments, step, LR schedule, data position)
after the move equal those before it, and the bytes moved equal the MovePlan's lower bound;
over the chain, the per-step losses, gradient norms and final parameters equal one process
training on the same samples within the equivalence matrix's tolerances (``test_equivalence``:
K x the fp32 one-device noise against fp64); and the sample ids the data-parallel ranks consumed
cover every position of the order once (no gap, no duplicate).
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from reference import ReferenceRun, deviation, reference_run
from test_equivalence import (
    FLOOR_FP32,
    K_FP32,
    OPTIM,
    SEED,
    SEQ,
    Expectation,
    _gpt,
    _plan,
    _worst,
    violations,
)

from meshmorph.spec.plan import Plan

WORLD = 4
GLOBAL_BATCH = 8


@dataclass(frozen=True, slots=True)
class Stage:
    """One plan of the chain and the processes it runs on."""

    name: str
    """Test id of the move into this plan (the first: the starting plan)."""
    plan: Plan
    """Plan trained for one step."""
    staying: tuple[int, ...] | None = None
    """Processes allowed to host it (a planned leave); None: any."""
    joining: tuple[int, ...] = ()
    """Processes without state that join for it."""


def chain() -> list[Stage]:
    gpt = _gpt()

    def plan(**kw: object) -> Plan:
        return _plan(gpt, global_batch=GLOBAL_BATCH, **kw)

    return [
        Stage("start_dp4", plan(dp=4, num_microbatches=2)),
        Stage("dp4_to_dp2_planned_leave", plan(dp=2, num_microbatches=4), staying=(0, 1)),
        Stage("dp2_to_zero3_dp4_join", plan(dp=4, zero=3, num_microbatches=2), joining=(2, 3)),
        Stage("zero3_dp4_to_tp2_pp2", plan(tp=2, pp=2, micro_batch=2, num_microbatches=4)),
        Stage("tp2_pp2_to_tp2_dp2", plan(tp=2, dp=2, micro_batch=2, num_microbatches=2)),
        Stage("tp2_dp2_to_pp2_dp2", plan(pp=2, dp=2, num_microbatches=4)),
        Stage("pp2_dp2_to_pp2_tp2", plan(pp=2, tp=2, micro_batch=2, num_microbatches=4)),
        Stage("pp2_tp2_to_zero3_dp4", plan(dp=4, zero=3, num_microbatches=2)),
    ]


MOVES = [stage.name for stage in chain()[1:]]


def batches(steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(0, _gpt().vocab_size, (GLOBAL_BATCH, SEQ + 1), generator=gen)
            for _ in range(steps)]


def _rank_step(engine, batch: torch.Tensor, consumed: int) -> tuple[float, float, list[int]]:  # noqa: ANN001
    share = GLOBAL_BATCH // engine.dp_size
    lo = engine.dp_rank * share
    loss = engine.step(batch[lo:lo + share])
    return loss, engine.grad_norm_last(), list(range(consumed + lo, consumed + lo + share))


def _full_params(engine) -> dict[str, torch.Tensor]:  # noqa: ANN001
    from torch.distributed.tensor import DTensor

    params = {}
    for part in engine.model_parts:
        for name, param in part.named_parameters(remove_duplicate=False):
            full = param.full_tensor() if isinstance(param, DTensor) else param
            params[name] = full.detach().clone()
    return params


def assert_matches_one_device(entries: Iterable[dict], param_files: Iterable[Path],
                              steps: int) -> None:
    """Every rank of a step reports the same loss and grad norm, and the losses, norms and the
    parameters saved in ``param_files`` equal the fp64 one-device run within K times the
    measured fp32 noise (test_equivalence's tolerances)."""
    by_step: dict[int, tuple[float, float]] = {}
    for entry in entries:
        got = (entry["loss"], entry["grad_norm"])
        assert by_step.setdefault(entry["step"], got) == got, entry
    assert sorted(by_step) == list(range(steps))
    params: dict[str, torch.Tensor] = {}
    for path in sorted(param_files):
        params.update(torch.load(path))
    run = ReferenceRun(tuple(by_step[s][0] for s in range(steps)),
                       tuple(by_step[s][1] for s in range(steps)), params)
    gpt, data = _gpt(), batches(steps)
    fp64 = reference_run(gpt, OPTIM, data, seed=SEED, micro_batch=1, precision="fp64")
    noise = _worst([deviation(reference_run(gpt, OPTIM, data, seed=SEED, micro_batch=mb,
                                            precision="fp32"), fp64, OPTIM)
                    for mb in (1, 2, GLOBAL_BATCH)])
    found = violations(run, Expectation(fp64, "fp64 one-device", fp64, noise, K_FP32, FLOOR_FP32))
    assert not found, "\n".join(found)


def assert_every_sample_once(entries: Iterable[dict], steps: int) -> None:
    """Every rank of one dp rank read the same sample ids in a step, and over ``steps`` steps
    every sample id was consumed exactly once."""
    seen: dict[int, dict[int, list[int]]] = {}  # step -> dp rank -> sample ids
    for entry in entries:
        ids = seen.setdefault(entry["step"], {}).setdefault(entry["dp_rank"], entry["ids"])
        assert ids == entry["ids"]
    consumed = sorted(i for step in seen.values() for ids in step.values() for i in ids)
    assert consumed == list(range(steps * GLOBAL_BATCH))


def job(rank: int, world_size: int, out_dir: str) -> None:
    """Spawned on every process: the whole chain, one step per plan, a move between plans."""
    import torch.distributed as dist

    from meshmorph.elastic.live.controller import ReshapeRequest, reshape_in_memory
    from meshmorph.elastic.live.local_state import extract_state, state_hashes
    from meshmorph.run.engine.train_engine import build_engine

    out = Path(out_dir)
    stages, data = chain(), batches(len(chain()))
    gpt = _gpt()
    try:
        engine = build_engine(gpt, stages[0].plan, OPTIM, seed=SEED, device=torch.device("cpu"))
        processes = tuple(range(world_size))
        consumed, record = 0, []
        for index, stage in enumerate(stages):
            if index:
                if engine is not None:
                    small = extract_state(engine, consumed_samples=consumed, checksums=False).small
                    before = state_hashes(engine, small)
                    if dist.get_rank() == 0:
                        (out / f"{stage.name}.before.json").write_text(json.dumps(before))
                request = ReshapeRequest(model=gpt, optim=OPTIM, plan_a=stages[index - 1].plan,
                                         processes_a=processes, plan_b=stage.plan,
                                         staying=stage.staying, joining=stage.joining, seed=99)
                engine, report = reshape_in_memory(request, rank, engine,
                                                   consumed_samples=consumed, store_dir=out,
                                                   tag=f"move{index}")
                processes = report.processes_b
                consumed = report.consumed_samples  # the data position moves with the state
                if engine is not None:
                    small = extract_state(engine, consumed_samples=consumed, checksums=False).small
                    after = state_hashes(engine, small)
                    if dist.get_rank() == 0:
                        (out / f"{stage.name}.after.json").write_text(json.dumps(
                            {**report.figures(), "processes": processes,
                             "times_s": report.times_s, "hashes": after}))
            if engine is None:
                continue
            loss, norm, ids = _rank_step(engine, data[index], consumed)
            consumed += GLOBAL_BATCH
            record.append({"step": index, "loss": loss, "grad_norm": norm,
                           "dp_rank": engine.dp_rank, "ids": ids})
        torch.save(_full_params(engine), out / f"params{rank}_pp{engine.train_mesh.pp_rank}.pt")
        (out / f"rank{rank}.json").write_text(json.dumps(record))
        dist.barrier()
    except Exception:
        (out / f"error{rank}.txt").write_text(traceback.format_exc())
        raise


def run_chain(out: Path) -> None:
    from spawn import spawn

    spawn(job, WORLD, (str(out),), timeout_s=240, collective_timeout_s=60)


@pytest.fixture(scope="module")
def chain_results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("reshape")
    run_chain(out)
    return out


def _records(out: Path) -> list[list[dict]]:
    errors = sorted(out.glob("error*.txt"))
    assert not errors, "\n".join(e.read_text() for e in errors)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize("move", MOVES)
def test_move_keeps_every_tensor_hash_and_moves_the_lower_bound(move: str,
                                                                chain_results: Path) -> None:
    _records(chain_results)
    before = json.loads((chain_results / f"{move}.before.json").read_text())
    after = json.loads((chain_results / f"{move}.after.json").read_text())
    assert len(before) == len(after["hashes"]) > 100
    changed = sorted(k for k in before if after["hashes"].get(k) != before[k])
    assert changed == [], f"{move}: {len(changed)} tensors changed in the move: {changed[:5]}"
    assert after["bytes_moved"] == after["lower_bound_bytes"]
    assert after["bytes_moved"] <= after["naive_bytes"]


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_chain_of_reshapes_matches_one_device_losses_norms_and_params(chain_results: Path) -> None:
    entries = [entry for record in _records(chain_results) for entry in record]
    assert_matches_one_device(entries, chain_results.glob("params*_pp*.pt"), len(chain()))


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_chain_of_reshapes_consumes_every_sample_once(chain_results: Path) -> None:
    # tp and pp ranks of one dp rank read the same samples
    entries = [entry for record in _records(chain_results) for entry in record]
    assert_every_sample_once(entries, len(chain()))
