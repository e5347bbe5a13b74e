"""The test oracle: one process trains the whole model on whole global batches, in a chosen
precision, with the arithmetic every layout must reproduce.

``reference_run`` builds the model from the same seed (the same initial values as every layout's
shards), cuts each global batch into micro-batches, back-propagates each micro-batch's mean token
loss scaled by 1/m, takes the global gradient norm, clips (torch's rule: coefficient
``clip / (norm + 1e-6)``, capped at 1) and steps AdamW under the configured LR schedule. It
shares no code with the runtime it checks beyond the model definition and ``OptimConfig``.

Precisions:

- ``fp64``: the model, its gradients and AdamW in float64: the truth every fp32 layout is
  measured against (its own rounding is ~1e-16, far below what the tests resolve).
- ``fp32``: the same in float32: its distance from ``fp64`` is the floating-point noise of one
  fp32 device, the yardstick the tolerances are built from.
- ``bf16``: mixed precision as one device runs it: fp32 master weights, gradients and AdamW,
  the forward under ``torch.autocast`` (bfloat16), the loss taken from fp32 logits.
- ``bf16_params``: mixed precision as FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)`` runs it (meshmorph's ZeRO-2/3 over dp > 1): fp32 master weights and
  AdamW, every micro-batch's forward and backward on a bfloat16 copy of all the parameters (the
  norms, biases and residual stream in bf16 too, not only the matmuls), its bf16 gradients
  accumulated into fp32 ones.

``deviation`` measures one run against another: per-step relative loss and gradient-norm
differences, and per parameter tensor the norm-relative difference ``||a - b|| / scale`` with
``scale = max(||b||, sqrt(n) * sum of the steps' learning rates)``. The second term is how far
AdamW can move a tensor of ``n`` elements in those steps (about one learning rate per element per
step): a tensor whose true value stays near zero is measured against the distance training could
have moved it, not against its own vanishing norm. (GPT key biases are such tensors: softmax
ignores a shift common to every key, so their true gradient is zero and fp32 leaves only
rounding there; their fp64 norm is ~1e-17.) Elementwise tolerances are what made the matrix
flaky: AdamW divides each gradient element by its own magnitude, so an element whose gradient
is near zero turns summation-order noise into a visibly different update.
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from meshmorph.run.config import OptimConfig
from meshmorph.run.model.decoder import build_model
from meshmorph.spec.model import ModelSpec

PRECISIONS = ("fp64", "fp32", "bf16", "bf16_params")
"""The precisions ``reference_run`` trains in."""


@dataclass(frozen=True, slots=True)
class ReferenceRun:
    """What one training run gives back, for comparison."""

    losses: tuple[float, ...]
    """Mean token loss over the global batch, per step."""
    grad_norms: tuple[float, ...]
    """Global gradient norm before clipping, per step."""
    params: dict[str, torch.Tensor]
    """Final parameters by name (``state_dict`` names of the whole model)."""


@dataclass(frozen=True, slots=True)
class Deviation:
    """How far a run is from another one taken as the truth."""

    loss_rel: float
    """Largest ``|a - b| / |b|`` over the steps' losses."""
    grad_norm_rel: float
    """Largest ``|a - b| / |b|`` over the steps' gradient norms."""
    param_rel: dict[str, float]
    """Per parameter tensor, ``||a - b|| / scale`` (Frobenius norms in float64; ``scale`` in the
    module docstring)."""
    param_max_abs: dict[str, float]
    """Per parameter tensor, the largest elementwise ``|a - b|`` (reported, not tested)."""

    @property
    def worst_param(self) -> str:
        """The tensor with the largest norm-relative difference."""
        return max(self.param_rel, key=self.param_rel.__getitem__)

    @property
    def param_rel_max(self) -> float:
        """The largest norm-relative difference over all tensors."""
        return self.param_rel[self.worst_param]


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy, taken in fp32 at least (in fp64 for an fp64 model)."""
    logits = logits.flatten(0, 1)
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    return F.cross_entropy(logits, labels.flatten())


def reference_run(model: ModelSpec, optim: OptimConfig, batches: list[torch.Tensor], *,
                  seed: int, micro_batch: int, precision: str = "fp64") -> ReferenceRun:
    """Train ``model`` in one process on ``batches`` (LongTensor[global_batch, s + 1] each) in
    ``precision``; see the module docstring."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {PRECISIONS}")
    dtype = torch.float64 if precision == "fp64" else torch.float32
    net = build_model(model, seed=seed, dtype=dtype)
    params = list(net.parameters())
    opt = torch.optim.AdamW(params, lr=optim.lr, betas=(optim.beta1, optim.beta2),
                            eps=optim.eps, weight_decay=optim.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: optim.lr_at(step) / optim.lr)
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if precision == "bf16" \
        else contextlib.nullcontext
    shadow = _bf16_copy(net) if precision == "bf16_params" else None
    losses, norms = [], []
    for batch in batches:
        if batch.shape[0] % micro_batch:
            raise ValueError(f"global batch {batch.shape[0]} is not a multiple of micro_batch "
                             f"{micro_batch}")
        m = batch.shape[0] // micro_batch
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for chunk in batch.chunk(m):
            if shadow is not None:
                total += _bf16_params_pass(net, shadow, chunk, m)
                continue
            with autocast():
                logits = net(chunk[:, :-1])
            loss = _loss(logits, chunk[:, 1:])
            (loss / m).backward()  # d(mean of m micro-batch means) = sum of d(loss_i) / m
            total += float(loss.detach())
        grads = [p.grad for p in params if p.grad is not None]
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
        coef = optim.grad_clip / (norm + 1e-6)
        if optim.grad_clip > 0 and coef < 1.0:
            for grad in grads:
                grad.mul_(coef)
        opt.step()
        sched.step()
        losses.append(total / m)
        norms.append(norm)
    return ReferenceRun(tuple(losses), tuple(norms),
                        {k: v.detach().clone() for k, v in net.state_dict().items()})


def _bf16_copy(net: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``net`` whose parameters are bfloat16 (buffers keep their dtype, as FSDP2's
    policy casts parameters only); tied parameters stay tied."""
    shadow = copy.deepcopy(net)
    for param in shadow.parameters():
        param.data = param.data.to(torch.bfloat16)
    return shadow


def _bf16_params_pass(net: torch.nn.Module, shadow: torch.nn.Module, chunk: torch.Tensor,
                      m: int) -> float:
    """One micro-batch on the bf16 copy of ``net``'s current fp32 parameters; its bf16
    gradients are added to ``net``'s fp32 ones. Returns the micro-batch's loss."""
    masters, copies = list(net.parameters()), list(shadow.parameters())
    with torch.no_grad():
        for master, low in zip(masters, copies, strict=True):
            low.copy_(master)
            low.grad = None
    loss = _loss(shadow(chunk[:, :-1]), chunk[:, 1:])
    (loss / m).backward()
    for master, low in zip(masters, copies, strict=True):
        if low.grad is None:
            continue
        if master.grad is None:
            master.grad = low.grad.float()
        else:
            master.grad.add_(low.grad.float())
    return float(loss.detach())


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else abs(a - b)


def deviation(run: ReferenceRun, truth: ReferenceRun, optim: OptimConfig) -> Deviation:
    """``run`` measured against ``truth`` (same steps, same parameter names, trained with
    ``optim``)."""
    lr_total = sum(optim.lr_at(step) for step in range(len(truth.losses)))
    if len(run.losses) != len(truth.losses):
        raise ValueError(f"{len(run.losses)} steps against {len(truth.losses)}")
    if sorted(run.params) != sorted(truth.params):
        missing = sorted(set(truth.params) - set(run.params))
        extra = sorted(set(run.params) - set(truth.params))
        raise ValueError(f"parameter names differ: missing {missing}, unexpected {extra}")
    rel, max_abs = {}, {}
    for name, want in truth.params.items():
        got = run.params[name].double()
        want = want.double()
        if got.shape != want.shape:
            raise ValueError(f"{name}: shape {list(got.shape)} against {list(want.shape)}")
        scale = max(float(want.norm()), math.sqrt(want.numel()) * lr_total)
        rel[name] = float((got - want).norm()) / scale
        max_abs[name] = float((got - want).abs().max()) if want.numel() else 0.0
    return Deviation(
        loss_rel=max(_rel(a, b) for a, b in zip(run.losses, truth.losses, strict=True)),
        grad_norm_rel=max(_rel(a, b) for a, b in
                          zip(run.grad_norms, truth.grad_norms, strict=True)),
        param_rel=rel, param_max_abs=max_abs)
