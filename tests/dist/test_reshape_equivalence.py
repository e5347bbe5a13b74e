"""Reshaping a running job in memory trains to the numbers of one device.

A part of the 4-process ``world4`` job (fp32, gpt-tiny, global batch 8) trains one step under each plan
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
K x the fp32 one-device noise against fp64, ``tests/helpers/oracle.py``); and the sample ids the data-parallel ranks consumed
cover every position of the order once (no gap, no duplicate).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from meshmorph.spec.plan import Plan
from tests.helpers.harness import full_params
from tests.helpers.oracle import OPTIM, SEED, even_plan, gpt_tiny
from tests.helpers.reshape import (
    GLOBAL_BATCH,
    WORLD,
    assert_every_sample_once,
    assert_matches_one_device,
    batches,
    rank_step,
)
from tests.helpers.world import Part, part_folder


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
    gpt = gpt_tiny()

    def plan(**kw: object) -> Plan:
        return even_plan(gpt, global_batch=GLOBAL_BATCH, **kw)

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


def chain_part(rank: int, world_size: int, out: Path) -> None:
    """On every process: the whole chain, one step per plan, a move between plans."""
    import torch.distributed as dist

    from meshmorph.elastic.live.controller import ReshapeRequest, reshape_in_memory
    from meshmorph.elastic.live.local_state import extract_state, state_hashes
    from meshmorph.run.engine.train_engine import build_engine

    stages, data = chain(), batches(len(chain()))
    gpt = gpt_tiny()
    engine = build_engine(gpt, stages[0].plan, OPTIM, seed=SEED, device=torch.device("cpu"))
    processes = tuple(range(world_size))
    consumed, record = 0, []
    for index, stage in enumerate(stages):
        if index:
            if engine is not None:
                small = extract_state(engine, consumed_samples=consumed).small
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
                small = extract_state(engine, consumed_samples=consumed).small
                after = state_hashes(engine, small)
                if dist.get_rank() == 0:
                    (out / f"{stage.name}.after.json").write_text(json.dumps(
                        {**report.figures(), "processes": processes,
                         "times_s": report.times_s, "hashes": after}))
        if engine is None:
            continue
        loss, norm, ids = rank_step(engine, data[index], consumed)
        consumed += GLOBAL_BATCH
        record.append({"step": index, "loss": loss, "grad_norm": norm,
                       "dp_rank": engine.dp_rank, "ids": ids})
    torch.save(full_params(engine), out / f"params{rank}_pp{engine.train_mesh.pp_rank}.pt")
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()


WORLD_PARTS = [Part("reshape_chain", chain_part, world=WORLD, timeout_s=180, regroups=True)]


@pytest.fixture(scope="module")
def chain_results(world4: Path) -> Path:
    return part_folder(world4, "reshape_chain")


def _records(out: Path) -> list[list[dict]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.dist
@pytest.mark.timeout(60, func_only=True)
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
@pytest.mark.timeout(60, func_only=True)
def test_chain_of_reshapes_matches_one_device_losses_norms_and_params(chain_results: Path) -> None:
    entries = [entry for record in _records(chain_results) for entry in record]
    assert_matches_one_device(entries, chain_results.glob("params*_pp*.pt"), len(chain()))


@pytest.mark.dist
@pytest.mark.timeout(60, func_only=True)
def test_chain_of_reshapes_consumes_every_sample_once(chain_results: Path) -> None:
    # tp and pp ranks of one dp rank read the same samples
    entries = [entry for record in _records(chain_results) for entry in record]
    assert_every_sample_once(entries, len(chain()))
