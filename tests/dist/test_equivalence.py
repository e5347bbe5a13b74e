"""Every layout of the matrix trains to the numbers of one process.

All layouts run inside one spawned 4-process gloo job (one process group, each rank loops over
the layouts and rebuilds its engine); every rank reports per layout to a result directory and
each layout is then checked by its own test against ``reference_losses``: per-step losses within
relative 1e-5 and final parameters allclose (rtol 1e-4, atol 1e-6).
"""

from __future__ import annotations

import gc
import json
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from meshmorph.spec.plan import Plan, PlanError, Schedule, StagePlan
from meshmorph.run.config import OptimConfig
from meshmorph.spec.catalog import catalog_model
from meshmorph.spec.model import ModelSpec, Recompute
from meshmorph.spec.transformer import TransformerShape, build_transformer

WORLD = 4
STEPS = 3
SEED = 7
SEQ = 16
# A small clip keeps clipping active on every step. Adam divides each gradient element by its own
# magnitude, so an element whose gradient is near zero turns summation-order noise (~1e-7
# relative) into a visibly different update; eps 1e-6 damps exactly those elements.
OPTIM = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=1, decay_steps=10, weight_decay=0.1,
                    eps=1e-6, grad_clip=0.5)


@dataclass(frozen=True, slots=True)
class Layout:
    """One entry of the equivalence matrix."""

    name: str
    """Test id."""
    model: ModelSpec
    """Model the layout trains."""
    plan: Plan
    """The parallel layout (world size 4)."""


def _gpt() -> ModelSpec:
    return catalog_model("gpt-tiny", seq_len=SEQ)


def _llama() -> ModelSpec:
    return catalog_model("llama-tiny", seq_len=SEQ)


def _gpt_deep() -> ModelSpec:
    """8 blocks: one per chunk of pp 4 x vpp 2."""
    return build_transformer(TransformerShape(name="gpt-deep", arch="gpt", num_layers=8,
                                              hidden_size=32, num_heads=4, vocab_size=128,
                                              seq_len=SEQ))


def _gpt_odd_vocab() -> ModelSpec:
    """A vocabulary tp 2 does not divide: embedding and head stay replicated."""
    return build_transformer(TransformerShape(name="gpt-odd-vocab", arch="gpt", num_layers=2,
                                              hidden_size=32, num_heads=4, vocab_size=251,
                                              seq_len=SEQ))


def _plan(model: ModelSpec, **kw: object) -> Plan:
    return Plan(model=model.name, seq_len=SEQ, dtype="fp32", **kw).with_even_stages(model)  # type: ignore[arg-type]


def _recompute_stages(model: ModelSpec) -> tuple[StagePlan, ...]:
    n, f, s = Recompute.NONE, Recompute.FULL, Recompute.SELECTIVE
    return (StagePlan(start=0, stop=3, recompute=(n, f, s)),
            StagePlan(start=3, stop=6, recompute=(s, f, n)))


def layouts() -> list[Layout]:
    gpt, llama, deep = _gpt(), _llama(), _gpt_deep()
    return [
        Layout("dp4", gpt, _plan(gpt, dp=4, global_batch=8, num_microbatches=2)),
        Layout("zero3_dp4", gpt, _plan(gpt, dp=4, zero=3, global_batch=8, num_microbatches=2)),
        Layout("zero1_dp4", gpt, _plan(gpt, dp=4, zero=1, global_batch=8, num_microbatches=2)),
        Layout("tp2_dp2_sp_zero2", gpt, _plan(gpt, tp=2, dp=2, zero=2, sequence_parallel=True,
                                              global_batch=8, num_microbatches=2, micro_batch=2)),
        Layout("tp2_dp2_replicate", llama, _plan(llama, tp=2, dp=2, global_batch=4,
                                                 num_microbatches=2)),
        Layout("pp2_dp2_1f1b", gpt, _plan(gpt, pp=2, dp=2, global_batch=8, num_microbatches=4)),
        Layout("pp2_tp2", gpt, _plan(gpt, pp=2, tp=2, global_batch=4, num_microbatches=2,
                                     micro_batch=2)),
        Layout("pp4_interleaved_vpp2", deep,
               _plan(deep, pp=4, vpp=2, schedule=Schedule.INTERLEAVED, global_batch=4,
                     num_microbatches=4)),
        Layout("pp2_zero3_dp2_recompute", gpt,
               replace(_plan(gpt, pp=2, dp=2, zero=3, global_batch=4, num_microbatches=2),
                       stages=_recompute_stages(gpt))),
        Layout("gpipe_pp2_dp2", llama, _plan(llama, pp=2, dp=2, schedule=Schedule.GPIPE,
                                             global_batch=6, num_microbatches=3)),
        Layout("zb_pp2_dp2", gpt, _plan(gpt, pp=2, dp=2, zero=1, schedule=Schedule.ZERO_BUBBLE,
                                        global_batch=8, num_microbatches=4)),
        Layout("zero3_tp2_dp2", gpt, _plan(gpt, tp=2, dp=2, zero=3, global_batch=8,
                                           num_microbatches=2, micro_batch=2)),
        Layout("tp4_sp", gpt, _plan(gpt, tp=4, sequence_parallel=True, global_batch=4,
                                    num_microbatches=2, micro_batch=2)),
        Layout("zb_pp2_dp2_replicate", gpt,
               _plan(gpt, pp=2, dp=2, schedule=Schedule.ZERO_BUBBLE, global_batch=8,
                     num_microbatches=4)),
        Layout("tp2_sp_dp2_odd_vocab", _gpt_odd_vocab(),
               _plan(_gpt_odd_vocab(), tp=2, dp=2, zero=3, sequence_parallel=True, global_batch=4,
                     num_microbatches=2)),
        Layout("llama_gqa_tp2_pp2", llama, _plan(llama, tp=2, pp=2, sequence_parallel=True,
                                                 global_batch=4, num_microbatches=2,
                                                 micro_batch=2)),
    ]


def batches(model: ModelSpec, plan: Plan) -> list[torch.Tensor]:
    """STEPS global batches of tokens, LongTensor[global_batch, s + 1]."""
    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(0, model.vocab_size, (plan.global_batch, SEQ + 1), generator=gen)
            for _ in range(STEPS)]


def run_layout(layout: Layout, out: Path, rank: int) -> None:
    """Train one layout on this rank; rank 0 writes losses, first dp/tp ranks write params."""
    from torch.distributed.tensor import DTensor

    from meshmorph.run.engine import build_engine

    engine = build_engine(layout.model, layout.plan, OPTIM, seed=SEED, device=torch.device("cpu"))
    share = layout.plan.global_batch // layout.plan.dp
    losses, norms, times = [], [], []
    for batch in batches(layout.model, layout.plan):
        start = time.perf_counter()
        losses.append(engine.step(batch[engine.dp_rank * share:(engine.dp_rank + 1) * share]))
        times.append(time.perf_counter() - start)
        norms.append(engine.grad_norm_last())
    params = {}
    for part in engine.model_parts:
        for name, param in part.named_parameters(remove_duplicate=False):
            full = param.full_tensor() if isinstance(param, DTensor) else param
            params[name] = full.detach().clone()
    mesh = engine.train_mesh
    if mesh.dp_rank == 0 and mesh.tp_rank == 0:
        torch.save(params, out / f"params_pp{mesh.pp_rank}.pt")
    (out / f"rank{rank}.json").write_text(json.dumps(
        {"losses": losses, "grad_norms": norms, "step_s": times}))


def job(rank: int, world_size: int, result_dir: str, names: list[str] | None = None) -> None:
    """Spawned on every rank: all layouts in turn, one process group."""
    import torch.distributed as dist

    for layout in layouts():
        if names and layout.name not in names:
            continue
        out = Path(result_dir) / layout.name
        out.mkdir(parents=True, exist_ok=True)
        try:
            run_layout(layout, out, rank)
        except Exception:
            (out / f"error{rank}.txt").write_text(traceback.format_exc())
            print(f"rank {rank} layout {layout.name} failed:\n{traceback.format_exc()}", flush=True)
        gc.collect()
        dist.barrier()


@pytest.fixture(scope="session")
def matrix_results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from spawn import spawn

    # one thread for the single-process references too: two spinning OpenMP threads on a machine
    # whose cores other processes hold slow every kernel down many times over
    torch.set_num_threads(1)
    result_dir = tmp_path_factory.mktemp("equivalence")
    spawn(job, WORLD, (str(result_dir),), timeout_s=420, collective_timeout_s=60)
    return result_dir


@pytest.mark.dist
@pytest.mark.timeout(480)
@pytest.mark.parametrize("layout", layouts(), ids=lambda layout: layout.name)
def test_layout_matches_single_process_losses_norms_and_params(layout: Layout,
                                                               matrix_results: Path) -> None:
    from meshmorph.run.engine import reference_losses

    out = matrix_results / layout.name
    errors = sorted(out.glob("error*.txt"))
    assert not errors, "\n".join(e.read_text() for e in errors)
    ref_norms: list[float] = []
    ref_losses, ref_state = reference_losses(layout.model, OPTIM, batches(layout.model, layout.plan),
                                             seed=SEED, micro_batch=layout.plan.micro_batch,
                                             grad_norms=ref_norms)
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for report in reports:  # every rank returns the same loss and norm
        assert report["losses"] == reports[0]["losses"]
        assert report["grad_norms"] == reports[0]["grad_norms"]
    assert len(reports[0]["losses"]) == STEPS
    torch.testing.assert_close(torch.tensor(reports[0]["losses"], dtype=torch.float64),
                               torch.tensor(ref_losses, dtype=torch.float64), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(reports[0]["grad_norms"], dtype=torch.float64),
                               torch.tensor(ref_norms, dtype=torch.float64), rtol=1e-5, atol=0)
    params: dict[str, torch.Tensor] = {}
    for path in sorted(out.glob("params_pp*.pt")):
        params.update(torch.load(path))
    assert sorted(params) == sorted(ref_state), "parameter names differ from the single model"
    for name, value in ref_state.items():
        torch.testing.assert_close(params[name], value, rtol=1e-4, atol=1e-6, msg=name)


# --- bad plans are refused before any process group exists ---------------------------------------

def test_degrees_not_multiplying_to_world_size_are_refused() -> None:
    from meshmorph.run.engine import validate_plan

    gpt = _gpt()
    with pytest.raises(PlanError, match=r"tp 2 x pp 1 x dp 2 = 4 ranks, but the job has 8"):
        validate_plan(gpt, _plan(gpt, tp=2, dp=2, global_batch=2), 8)


def test_stages_naming_layers_the_model_lacks_are_refused() -> None:
    from meshmorph.run.engine import validate_plan

    gpt = _gpt()  # 6 layers: embedding, 4 blocks, head
    n = Recompute.NONE
    plan = replace(_plan(gpt, pp=2, global_batch=2, num_microbatches=2),
                   stages=(StagePlan(start=0, stop=4, recompute=(n,) * 4),
                           StagePlan(start=4, stop=8, recompute=(n,) * 4)))
    with pytest.raises(PlanError, match=r"cover layers \[0, 8\) but model gpt-tiny has 6 layers"):
        validate_plan(gpt, plan, 2)


def test_tp_not_dividing_heads_is_refused() -> None:
    from meshmorph.run.engine import validate_plan

    odd = build_transformer(TransformerShape(name="gpt-odd", arch="gpt", num_layers=2,
                                             hidden_size=48, num_heads=3, vocab_size=64,
                                             seq_len=SEQ))
    with pytest.raises(PlanError, match="tp 2 does not divide num_heads 3"):
        validate_plan(odd, _plan(odd, tp=2, global_batch=1), 2)


def test_plan_for_another_sequence_length_is_refused() -> None:
    from meshmorph.run.engine import validate_plan

    gpt = catalog_model("gpt-tiny")  # seq_len 32
    with pytest.raises(PlanError, match="plan seq_len 16 != model seq_len 32"):
        validate_plan(gpt, _plan(gpt, dp=2, global_batch=2), 2)


def test_build_engine_without_a_process_group_says_how_to_start_one() -> None:
    from meshmorph.run.engine import build_engine

    gpt = _gpt()
    with pytest.raises(RuntimeError, match="needs torch.distributed initialised"):
        build_engine(gpt, _plan(gpt, global_batch=1), OPTIM, seed=0, device=torch.device("cpu"))
