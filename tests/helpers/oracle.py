"""The equivalence matrix's rule: what a parallel run is compared with, and how closely.

A run in fp32 is held to the **float64 one-device run** (``reference.reference_run``: same
initial values, batches, loss scaling, clipping, AdamW and LR schedule); a run in bf16 to the
**bf16 one-device run** computing as it does, and it must show bf16 rounding at all. Each figure
(per-step losses and gradient norms, every final parameter tensor) has a tolerance of
``K x max(baseline, FLOOR)``, the baseline being that figure measured for one device: for fp32
the largest deviation from fp64 of three fp32 one-device runs (micro-batch 1, the plan's, the
whole global batch), for bf16 the bf16 run's deviation from fp64. Why K = 10, measured:
tests/dist/test_equivalence.py's docstring.

The matrix's shared settings (``SEQ``, ``SEED``, ``OPTIM``, ``gpt_tiny``, ``even_plan``) live here
too: the reshape and elastic tests train the same model under the same optimizer.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from meshmorph.run.config import OptimConfig
from meshmorph.spec.catalog import catalog_model
from meshmorph.spec.model import ModelSpec
from meshmorph.spec.plan import Plan
from tests.helpers.reference import Deviation, ReferenceRun, deviation, reference_run

SEQ = 16
SEED = 7
# A small clip keeps clipping active on every step; eps 1e-6 keeps AdamW from dividing
# near-zero gradient elements by their own rounding noise.
OPTIM = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=1, decay_steps=10, weight_decay=0.1,
                    eps=1e-6, grad_clip=0.5)

K_FP32 = 10.0
"""An fp32 run may deviate from fp64 by this many times one fp32 device's deviation."""
FLOOR_FP32 = 1e-7
"""The fp32 baseline is never taken below this (about one fp32 rounding, 2**-24 = 6e-8)."""
K_BF16 = 10.0
"""A bf16 run may deviate from the bf16 one-device run by this many times that run's own
deviation from fp64."""
FLOOR_BF16 = 1e-4
"""The bf16 baseline is never taken below this (a bf16 rounding is 2**-9 = 2e-3)."""
BF16_SHOWN = 0.1
"""A bf16 run must sit at least this fraction of the bf16 one-device run's median tensor
deviation away from fp64: otherwise it did not compute in bf16."""


def gpt_tiny(seq_len: int = SEQ) -> ModelSpec:
    """The catalog's gpt-tiny (embedding, 4 blocks, tied head) at ``seq_len``."""
    return catalog_model("gpt-tiny", seq_len=seq_len)


def even_plan(model: ModelSpec, dtype: str = "fp32", **kw: object) -> Plan:
    """A Plan for ``model`` at its sequence length with even stages."""
    return Plan(model=model.name, seq_len=model.seq_len, dtype=dtype,  # type: ignore[arg-type]
                **kw).with_even_stages(model)


def token_batches(model: ModelSpec, global_batch: int, steps: int,
                  seed: int = 1234) -> list[torch.Tensor]:
    """``steps`` global batches of random tokens, LongTensor[global_batch, s + 1] each."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, model.vocab_size, (global_batch, model.seq_len + 1), generator=gen)
            for _ in range(steps)]


def worst(devs: list[Deviation]) -> Deviation:
    """Figure by figure, the largest of several deviations."""
    return Deviation(loss_rel=max(d.loss_rel for d in devs),
                     grad_norm_rel=max(d.grad_norm_rel for d in devs),
                     param_rel={n: max(d.param_rel[n] for d in devs) for n in devs[0].param_rel},
                     param_max_abs={n: max(d.param_max_abs[n] for d in devs)
                                    for n in devs[0].param_max_abs})


@dataclass(frozen=True, slots=True)
class Expectation:
    """What one run is compared with, and how closely."""

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


def fp32_expectation(model: ModelSpec, data: list[torch.Tensor], *, micro_batch: int,
                     noise_micro_batches: tuple[int, ...] | None = None,
                     optim: OptimConfig = OPTIM, seed: int = SEED,
                     fp64: ReferenceRun | None = None,
                     runs: dict[int, ReferenceRun] | None = None) -> Expectation:
    """The fp64 one-device run at ``micro_batch`` as the truth, and as the noise the worst
    deviation from it of the fp32 one-device runs at ``noise_micro_batches`` (default:
    micro-batch 1, ``micro_batch`` and the whole global batch: three summation orders). ``fp64``
    and ``runs`` (fp32 runs by micro-batch) are reused where given."""
    if fp64 is None:
        fp64 = reference_run(model, optim, data, seed=seed, micro_batch=micro_batch,
                             precision="fp64")
    runs = runs or {}
    if noise_micro_batches is None:
        noise_micro_batches = tuple(sorted({1, micro_batch, data[0].shape[0]}))
    fp32 = [runs[mb] if mb in runs else
            reference_run(model, optim, data, seed=seed, micro_batch=mb, precision="fp32")
            for mb in noise_micro_batches]
    return Expectation(fp64, "fp64 one-device", fp64,
                       worst([deviation(run, fp64, optim) for run in fp32]), K_FP32, FLOOR_FP32)


def violations(run: ReferenceRun, exp: Expectation, optim: OptimConfig = OPTIM) -> list[str]:
    """Every figure of ``run`` outside its tolerance, with the numbers that decided it."""
    dev, base = deviation(run, exp.truth, optim), exp.baseline
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


def bf16_not_shown(run: ReferenceRun, exp: Expectation, optim: OptimConfig = OPTIM) -> str | None:
    """Why ``run`` cannot have computed in bf16 (None if its distance from fp64 shows it did)."""
    got = _median_param_rel(deviation(run, exp.fp64, optim))
    need = BF16_SHOWN * _median_param_rel(exp.baseline)
    if got >= need:
        return None
    return (f"median tensor distance from fp64 is {got:.3g}, below {need:.3g} = {BF16_SHOWN:g} x "
            f"the bf16 one-device run's {_median_param_rel(exp.baseline):.3g}: the layout "
            "trained in higher precision than its plan's bf16")
