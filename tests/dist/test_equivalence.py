"""Every layout of the matrix trains to the numbers of one device, within measured noise.

All layouts run inside one spawned 4-process gloo job (one process group; each rank loops over
the layouts and rebuilds its engine); every rank reports per layout to a result directory and
each layout is then checked by its own test against the oracle in ``reference.py``:

- an fp32 layout against the **float64 one-device run** (same initial values, batches, loss
  scaling, clipping, AdamW and LR schedule);
- a bf16 layout against the **bf16 one-device run** computing as the layout does (fp32 master
  weights; a bf16 autocast forward, or under ZeRO-2/3, whose FSDP2 MixedPrecisionPolicy casts
  every parameter, forward and backward on a bf16 copy of the parameters), and it must show bf16
  rounding at all (its distance from fp64 far above fp32 noise).

Each figure — the per-step losses, the per-step gradient norms (both relative differences) and
every final parameter tensor (norm-relative, ``||a - b|| / scale``, see ``reference.py``) — has
a tolerance of ``K x max(baseline, FLOOR)``, where the baseline is that same figure measured
for one device: for fp32 layouts the largest deviation from fp64 of three fp32 one-device runs
(micro-batch 1, the plan's, and the whole global batch: three summation orders), for bf16
layouts the deviation of the bf16 one-device run from fp64. A parameter tensor's baseline is
never taken below the median tensor's: its own is one sample of its rounding noise, and one
that came out small says little about the next summation order. So each layout is held to a
multiple of the noise its own precision shows on one device, tensor by tensor.

Why K = 10. Measured on this matrix (4 gloo processes on CPU), a layout's ratio is its
deviation over the baseline as above, figure by figure. With the runtime as it stands the
largest fp32 ratios were 3.6 for a parameter tensor (zero3_tp2_dp2 and tp2_dp2_sp_zero2, the
position embedding), 1.2 for gradient norms (gpipe_pp2_dp2) and 0.4 for losses; the largest
bf16 ratios 3.0 for a tensor, 3.2 for gradient norms and 0.3 for losses (all bf16_zero3_dp4,
then measured against the autocast one-device run). That comparison later failed, the same way
on every rerun: blocks.0.mlp.fc2.bias at 25 x its baseline, one element whose gradient is near
zero taking AdamW's first step in the other direction. FSDP2's MixedPrecisionPolicy casts every
parameter to bf16 where autocast casts only the matmul inputs; against a one-device run on bf16
parameters (``reference.py``'s ``bf16_params``) bf16_zero3_dp4 lands within 1e-7 of its
baseline on every figure, the element included. Reruns of one runtime give the same numbers bit for bit; a change
of summation order in the runtime (fused AdamW, another init) moved the largest ratio by about
2x. K = 10 leaves about 3x over the largest ratio seen, and still refuses a 1% error in the
learning rate (``test_a_one_percent_higher_learning_rate_...``) by two orders of magnitude.
"""

from __future__ import annotations

import gc
import json
import statistics
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from reference import Deviation, ReferenceRun, deviation, reference_run

from meshmorph.plan.partition_search import stages_of_counts
from meshmorph.run.config import OptimConfig
from meshmorph.run.parallel.parallelize import uses_fsdp_precision
from meshmorph.spec.catalog import catalog_model
from meshmorph.spec.model import ModelSpec, Recompute
from meshmorph.spec.plan import Plan, PlanError, StagePlan
from meshmorph.schedule.table import Schedule
from meshmorph.spec.transformer import TransformerShape, build_transformer

WORLD = 4
STEPS = 3
SEED = 7
SEQ = 16
# A small clip keeps clipping active on every step; eps 1e-6 keeps AdamW from dividing
# near-zero gradient elements by their own rounding noise.
OPTIM = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=1, decay_steps=10, weight_decay=0.1,
                    eps=1e-6, grad_clip=0.5)

K_FP32 = 10.0
"""An fp32 layout may deviate from fp64 by this many times one fp32 device's deviation."""
FLOOR_FP32 = 1e-7
"""The fp32 baseline is never taken below this (about one fp32 rounding, 2**-24 = 6e-8)."""
K_BF16 = 10.0
"""A bf16 layout may deviate from the bf16 one-device run by this many times that run's own
deviation from fp64."""
FLOOR_BF16 = 1e-4
"""The bf16 baseline is never taken below this (a bf16 rounding is 2**-9 = 2e-3)."""
BF16_SHOWN = 0.1
"""A bf16 layout must sit at least this fraction of the bf16 one-device run's median tensor
deviation away from fp64: otherwise it did not compute in bf16."""


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


def _gpt_five() -> ModelSpec:
    """5 blocks: no even split over the 4 chunks of pp 2 x vpp 2."""
    return build_transformer(TransformerShape(name="gpt-five", arch="gpt", num_layers=5,
                                              hidden_size=32, num_heads=4, vocab_size=128,
                                              seq_len=SEQ))


def _gpt_odd_vocab() -> ModelSpec:
    """A vocabulary tp 2 does not divide: embedding and head stay replicated."""
    return build_transformer(TransformerShape(name="gpt-odd-vocab", arch="gpt", num_layers=2,
                                              hidden_size=32, num_heads=4, vocab_size=251,
                                              seq_len=SEQ))


def _plan(model: ModelSpec, dtype: str = "fp32", **kw: object) -> Plan:
    return Plan(model=model.name, seq_len=SEQ, dtype=dtype, **kw).with_even_stages(model)  # type: ignore[arg-type]


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
        Layout("zero2_dp4", gpt, _plan(gpt, dp=4, zero=2, global_batch=8, num_microbatches=2)),
        Layout("tp2_dp2_sp_zero2", gpt, _plan(gpt, tp=2, dp=2, zero=2, sequence_parallel=True,
                                              global_batch=8, num_microbatches=2, micro_batch=2)),
        Layout("tp2_dp2_replicate", llama, _plan(llama, tp=2, dp=2, global_batch=4,
                                                 num_microbatches=2)),
        Layout("pp2_dp2_1f1b", gpt, _plan(gpt, pp=2, dp=2, global_batch=8, num_microbatches=4)),
        Layout("pp2_dp2_zero2", gpt, _plan(gpt, pp=2, dp=2, zero=2, global_batch=8,
                                           num_microbatches=4)),
        Layout("pp2_dp2_zero3", llama, _plan(llama, pp=2, dp=2, zero=3, global_batch=8,
                                             num_microbatches=4)),
        Layout("pp2_tp2", gpt, _plan(gpt, pp=2, tp=2, global_batch=4, num_microbatches=2,
                                     micro_batch=2)),
        Layout("pp4_interleaved_vpp2", deep,
               _plan(deep, pp=4, vpp=2, schedule=Schedule.INTERLEAVED, global_batch=4,
                     num_microbatches=4)),
        # uneven interleaved chunks as the planner may choose them (plan.partition_search):
        # 3, 1, 1 and 0 blocks, the last chunk the head alone, tied to rank 0's embedding
        Layout("pp2_dp2_interleaved_uneven_5_blocks", _gpt_five(),
               replace(_plan(_gpt_five(), pp=2, dp=2, vpp=2, schedule=Schedule.INTERLEAVED,
                             global_batch=8, num_microbatches=4),
                       stages=stages_of_counts(_gpt_five(), (3, 1, 1, 0), Recompute.NONE))),
        Layout("pp2_zero3_dp2_recompute", gpt,
               replace(_plan(gpt, pp=2, dp=2, zero=3, global_batch=4, num_microbatches=2),
                       stages=_recompute_stages(gpt))),
        Layout("gpipe_pp2_dp2", llama, _plan(llama, pp=2, dp=2, schedule=Schedule.GPIPE,
                                             global_batch=6, num_microbatches=3)),
        Layout("zb_pp2_dp2", gpt, _plan(gpt, pp=2, dp=2, zero=1, schedule=Schedule.ZERO_BUBBLE,
                                        global_batch=8, num_microbatches=4)),
        # V placement: rank 0 holds chunks 0 and 3 (the embedding and its tied head), rank 1
        # chunks 1 and 2
        Layout("zbv_pp2_dp2", gpt, _plan(gpt, pp=2, dp=2, vpp=2, schedule=Schedule.ZBV,
                                         global_batch=8, num_microbatches=4)),
        Layout("dualpipev_pp2_dp2", gpt, _plan(gpt, pp=2, dp=2, vpp=2, zero=1,
                                               schedule=Schedule.DUALPIPEV, global_batch=8,
                                               num_microbatches=4)),
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
        # mixed precision: fp32 master weights, bf16 compute
        Layout("bf16_dp4", gpt, _plan(gpt, "bf16", dp=4, global_batch=8, num_microbatches=2)),
        Layout("bf16_zero3_dp4", gpt, _plan(gpt, "bf16", dp=4, zero=3, global_batch=8,
                                            num_microbatches=2)),
        Layout("bf16_tp2_dp2", llama, _plan(llama, "bf16", tp=2, dp=2, global_batch=4,
                                            num_microbatches=2)),
    ]


def batches(model: ModelSpec, plan: Plan) -> list[torch.Tensor]:
    """STEPS global batches of tokens, LongTensor[global_batch, s + 1]."""
    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(0, model.vocab_size, (plan.global_batch, SEQ + 1), generator=gen)
            for _ in range(STEPS)]


def run_layout(layout: Layout, out: Path, rank: int) -> None:
    """Train one layout on this rank; rank 0 writes losses, first dp/tp ranks write params."""
    from torch.distributed.tensor import DTensor

    from meshmorph.run.engine.train_engine import build_engine

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


def run_matrix(result_dir: Path, names: list[str] | None = None) -> None:
    """The one spawned 4-process job that trains every layout (or those in ``names``)."""
    from spawn import spawn

    spawn(job, WORLD, (str(result_dir), names), timeout_s=420, collective_timeout_s=60)


def layout_run(out: Path) -> ReferenceRun:
    """What the ranks of one layout reported, after checking they agree on losses and norms."""
    errors = sorted(out.glob("error*.txt"))
    assert not errors, "\n".join(e.read_text() for e in errors)
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for rank, report in enumerate(reports):  # every rank returns the same loss and norm
        assert report["losses"] == reports[0]["losses"], f"rank {rank} reports other losses"
        assert report["grad_norms"] == reports[0]["grad_norms"], f"rank {rank}: other norms"
    assert len(reports[0]["losses"]) == STEPS
    params: dict[str, torch.Tensor] = {}
    for path in sorted(out.glob("params_pp*.pt")):
        params.update(torch.load(path))
    return ReferenceRun(tuple(reports[0]["losses"]), tuple(reports[0]["grad_norms"]), params)


# --- what each layout is held to ------------------------------------------------------------------

_RUNS: dict[tuple[str, int, int, str], ReferenceRun] = {}


def _one_device(layout: Layout, precision: str, micro_batch: int | None = None) -> ReferenceRun:
    """The oracle's run for this layout's model and batches (cached across layouts)."""
    mb = layout.plan.micro_batch if micro_batch is None else micro_batch
    key = (layout.model.name, layout.plan.global_batch, mb, precision)
    if key not in _RUNS:
        _RUNS[key] = reference_run(layout.model, OPTIM, batches(layout.model, layout.plan),
                                   seed=SEED, micro_batch=mb, precision=precision)
    return _RUNS[key]


def _worst(devs: list[Deviation]) -> Deviation:
    """Figure by figure, the largest of several deviations."""
    return Deviation(loss_rel=max(d.loss_rel for d in devs),
                     grad_norm_rel=max(d.grad_norm_rel for d in devs),
                     param_rel={n: max(d.param_rel[n] for d in devs) for n in devs[0].param_rel},
                     param_max_abs={n: max(d.param_max_abs[n] for d in devs)
                                    for n in devs[0].param_max_abs})


@dataclass(frozen=True, slots=True)
class Expectation:
    """What one layout is compared with, and how closely."""

    truth: ReferenceRun
    """The one-device run the layout must reproduce."""
    truth_name: str
    """Its name in messages."""
    fp64: ReferenceRun
    """The float64 one-device run."""
    baseline: Deviation
    """The measured one-device deviation from fp64 in the layout's precision."""
    k: float
    """Tolerance = k x max(baseline, floor), figure by figure."""
    floor: float
    """Smallest baseline used for losses and gradient norms."""

    @property
    def param_floor(self) -> float:
        """Smallest baseline used for a parameter tensor: ``floor``, or the median tensor's
        one-device deviation if larger. A tensor's own one-device deviation is one sample of its
        rounding noise; one whose sample came out small is held to the model's typical tensor."""
        return max(self.floor, statistics.median(self.baseline.param_rel.values()))

    def tolerance(self, baseline: float, floor: float | None = None) -> float:
        """The tolerance of one figure whose one-device deviation is ``baseline``."""
        return self.k * max(baseline, self.floor if floor is None else floor)


def expectation(layout: Layout) -> Expectation:
    """The truth and the measured noise for ``layout``'s precision."""
    fp64 = _one_device(layout, "fp64")
    if layout.plan.dtype == "bf16":
        # ZeRO-2/3 compute through FSDP2's MixedPrecisionPolicy (every parameter cast to bf16),
        # the other layouts under autocast (matmul inputs only): each against one device
        # computing the same way
        fsdp = uses_fsdp_precision(layout.plan)
        precision = "bf16_params" if fsdp else "bf16"
        bf16 = _one_device(layout, precision)
        name = "bf16 one-device (bf16 parameters)" if fsdp else "bf16 one-device (autocast)"
        return Expectation(bf16, name, fp64, deviation(bf16, fp64, OPTIM), K_BF16, FLOOR_BF16)
    if layout.plan.dtype != "fp32":
        raise ValueError(f"no one-device oracle for dtype {layout.plan.dtype!r}")
    g = layout.plan.global_batch
    fp32 = [_one_device(layout, "fp32", mb) for mb in sorted({1, layout.plan.micro_batch, g})]
    return Expectation(fp64, "fp64 one-device", fp64,
                       _worst([deviation(run, fp64, OPTIM) for run in fp32]), K_FP32, FLOOR_FP32)


def violations(run: ReferenceRun, exp: Expectation) -> list[str]:
    """Every figure of ``run`` outside its tolerance, with the numbers that decided it."""
    dev, base = deviation(run, exp.truth, OPTIM), exp.baseline
    rule = f"{exp.k:g} x max(one-device baseline, {exp.floor:g})"
    found = []
    for what, got, noise in (("losses", dev.loss_rel, base.loss_rel),
                             ("gradient norms", dev.grad_norm_rel, base.grad_norm_rel)):
        if got > exp.tolerance(noise):
            found.append(f"{what}: max rel diff {got:.3g} > tolerance {exp.tolerance(noise):.3g}"
                         f" = {rule}, baseline {noise:.3g}")
    if found:
        found.append(f"  losses {list(run.losses)} vs {list(exp.truth.losses)}; grad norms "
                     f"{list(run.grad_norms)} vs {list(exp.truth.grad_norms)}")
    for name in sorted(dev.param_rel, key=dev.param_rel.__getitem__, reverse=True):
        tol = exp.tolerance(base.param_rel[name], exp.param_floor)
        if dev.param_rel[name] > tol:
            found.append(f"param {name}: ||a-b||/scale {dev.param_rel[name]:.3g} (max abs diff "
                         f"{dev.param_max_abs[name]:.3g}) > tolerance {tol:.3g} = {exp.k:g} x "
                         f"max(one-device baseline {base.param_rel[name]:.3g}, median tensor's "
                         f"or floor {exp.param_floor:.3g})")
    return found


def _median_param_rel(dev: Deviation) -> float:
    return statistics.median(dev.param_rel.values())


def bf16_not_shown(run: ReferenceRun, exp: Expectation) -> str | None:
    """Why ``run`` cannot have computed in bf16 (None if its distance from fp64 shows it did)."""
    got = _median_param_rel(deviation(run, exp.fp64, OPTIM))
    need = BF16_SHOWN * _median_param_rel(exp.baseline)
    if got >= need:
        return None
    return (f"median tensor distance from fp64 is {got:.3g}, below {need:.3g} = {BF16_SHOWN:g} x "
            f"the bf16 one-device run's {_median_param_rel(exp.baseline):.3g}: the layout "
            "trained in higher precision than its plan's bf16")


# --- the matrix ---------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def matrix_results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # one thread for the single-process references too: two spinning OpenMP threads on a machine
    # whose cores other processes hold slow every kernel down many times over
    torch.set_num_threads(1)
    result_dir = tmp_path_factory.mktemp("equivalence")
    run_matrix(result_dir)
    return result_dir


@pytest.mark.dist
@pytest.mark.timeout(480)
@pytest.mark.parametrize("layout", layouts(), ids=lambda layout: layout.name)
def test_layout_matches_one_device_within_measured_noise(layout: Layout,
                                                         matrix_results: Path) -> None:
    run = layout_run(matrix_results / layout.name)
    exp = expectation(layout)
    found = violations(run, exp)
    assert not found, (f"{layout.name} ({layout.plan.dtype}) against the {exp.truth_name} run, "
                       f"{len(found)} figures out of tolerance:\n" + "\n".join(found))
    if layout.plan.dtype == "bf16":
        why = bf16_not_shown(run, exp)
        assert why is None, f"{layout.name}: {why}"


# --- the check itself can fail ------------------------------------------------------------------

def _layout(name: str) -> Layout:
    return next(layout for layout in layouts() if layout.name == name)


def test_a_one_percent_higher_learning_rate_is_out_of_fp32_tolerance() -> None:
    layout = _layout("dp4")
    wrong = replace(OPTIM, lr=OPTIM.lr * 1.01, min_lr=OPTIM.min_lr * 1.01)
    run = reference_run(layout.model, wrong, batches(layout.model, layout.plan), seed=SEED,
                        micro_batch=1, precision="fp32")
    found = violations(run, expectation(layout))
    assert sum(line.startswith("param ") for line in found) > 10, found  # most tensors moved
    assert found[0].startswith("losses: max rel diff")  # steps 2 and 3 start elsewhere


def test_an_fp32_run_passed_off_as_bf16_is_refused() -> None:
    layout = _layout("bf16_dp4")
    fp32 = _one_device(layout, "fp32")
    why = bf16_not_shown(fp32, expectation(layout))
    assert why is not None and "higher precision" in why


# --- bad plans are refused before any process group exists ---------------------------------------

def test_degrees_not_multiplying_to_world_size_are_refused() -> None:
    from meshmorph.run.engine.train_engine import validate_plan

    gpt = _gpt()
    with pytest.raises(PlanError, match=r"tp 2 x pp 1 x dp 2 = 4 ranks, but the job has 8"):
        validate_plan(gpt, _plan(gpt, tp=2, dp=2, global_batch=2), 8)


def test_stages_naming_layers_the_model_lacks_are_refused() -> None:
    from meshmorph.run.engine.train_engine import validate_plan

    gpt = _gpt()  # 6 layers: embedding, 4 blocks, head
    n = Recompute.NONE
    plan = replace(_plan(gpt, pp=2, global_batch=2, num_microbatches=2),
                   stages=(StagePlan(start=0, stop=4, recompute=(n,) * 4),
                           StagePlan(start=4, stop=8, recompute=(n,) * 4)))
    with pytest.raises(PlanError, match=r"cover layers \[0, 8\) but model gpt-tiny has 6 layers"):
        validate_plan(gpt, plan, 2)


def test_tp_not_dividing_heads_is_refused() -> None:
    from meshmorph.run.engine.train_engine import validate_plan

    odd = build_transformer(TransformerShape(name="gpt-odd", arch="gpt", num_layers=2,
                                             hidden_size=48, num_heads=3, vocab_size=64,
                                             seq_len=SEQ))
    with pytest.raises(PlanError, match="tp 2 does not divide num_heads 3"):
        validate_plan(odd, _plan(odd, tp=2, global_batch=1), 2)


def test_plan_for_another_sequence_length_is_refused() -> None:
    from meshmorph.run.engine.train_engine import validate_plan

    gpt = catalog_model("gpt-tiny")  # seq_len 32
    with pytest.raises(PlanError, match="plan seq_len 16 != model seq_len 32"):
        validate_plan(gpt, _plan(gpt, dp=2, global_batch=2), 2)


def test_build_engine_without_a_process_group_says_how_to_start_one() -> None:
    from meshmorph.run.engine.train_engine import build_engine

    gpt = _gpt()
    with pytest.raises(RuntimeError, match="needs torch.distributed initialised"):
        build_engine(gpt, _plan(gpt, global_batch=1), OPTIM, seed=0, device=torch.device("cpu"))
