"""Asynchronous pipeline training: 1F1B without flush, each stage stepping as soon as a backward
is done (PipeDream), with weight stashing, PipeDream-2BW, or weight prediction (SpecTrain), and
synchronous 1F1B in the same executor as the reference.

Pipeline stage ``k`` is rank ``k`` of the default process group, one stage per rank. Activations
go forward and gradients back by ``isend`` (kept until complete) and a blocking ``recv``: every
send is posted without waiting, so the 1F1B order cannot deadlock. The forward runs the stage
through ``torch.func.functional_call`` with a set of leaf tensors standing for its parameters,
and the backward's weight gradients are added to the real parameters' ``.grad``; which leaves
each mode hands out is ``run/async_pipe/weights.py``'s (``none`` and synchronous 1F1B alias the
parameters; a prediction's ``s`` updates ahead are read from the action list, and the gradient
taken there is applied to the current weights).

The guard (prediction modes) measures, at each backward, how far the prediction missed; once per
``guard_every`` micro-batches every stage agrees on the worst window mean (all-reduce MAX on a
side group, at a point every rank reaches after the same backward) and, past the threshold, the
in-flight micro-batches drain with stashing and the rest of the run flushes (synchronous 1F1B).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

from meshmorph.run.async_pipe.actions import async_1f1b, drain_point, staleness, sync_1f1b, two_bw
from meshmorph.run.async_pipe.config import AsyncPipelineConfig
from meshmorph.run.async_pipe.prediction import PredictionGuard
from meshmorph.run.async_pipe.weights import WeightSource

log = logging.getLogger("meshmorph.async")

Batches = Callable[[int], tuple[torch.Tensor, torch.Tensor]]
"""Batch index -> (inputs, targets); stage 0 reads the inputs, the last stage the targets."""


@dataclass(slots=True)
class AsyncResult:
    """What one stage saw during ``train``."""

    losses: list[float] = field(default_factory=list)
    """Loss of each batch (last stage only; empty elsewhere)."""
    seconds: float = 0.0
    """Wall time of the training loop."""
    switched_at: int | None = None
    """Batch from which the run flushed after the guard tripped (None: it never did)."""
    guard_means: list[float] = field(default_factory=list)
    """Worst stage's mean prediction-error ratio at each guard check."""
    grads: list[list[torch.Tensor]] = field(default_factory=list)
    """Weight gradient of this stage's first ``record_grads`` backwards, in backward order."""


class AsyncPipeline:
    """Runs one pipeline stage (this rank's ``stage``) under ``config``."""

    def __init__(self, stage: nn.Module, config: AsyncPipelineConfig, *,
                 feature_shapes: Sequence[tuple[int, ...]],
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 lr_at: Callable[[int], float] | None = None,
                 forward_context: Callable[[], contextlib.AbstractContextManager[object]]
                 = contextlib.nullcontext) -> None:
        """``feature_shapes[k]``: shape of one sample entering stage ``k`` (k >= 1);
        ``lr_at(version)``: the learning rate of the stage's update number ``version`` (None:
        ``config.lr`` throughout); ``forward_context``: what each forward runs under (autocast)."""
        self.forward_context = forward_context
        self.k, self.p = dist.get_rank(), dist.get_world_size()
        if len(feature_shapes) != self.p:
            raise ValueError(f"feature_shapes lists {len(feature_shapes)} stages for a pipeline "
                             f"of {self.p} ranks; give one shape per stage")
        self.stage, self.config, self.loss_fn = stage, config, loss_fn
        self.feature_shapes = list(feature_shapes)
        self.names = [name for name, _ in stage.named_parameters()]
        self.params = [param for _, param in stage.named_parameters()]
        if config.optimizer == "sgd":
            self.optimizer: torch.optim.Optimizer = torch.optim.SGD(
                self.params, lr=config.lr, momentum=config.momentum)
        else:
            adamw = config.optimizer == "adamw"
            self.optimizer = (torch.optim.AdamW if adamw else torch.optim.Adam)(
                self.params, lr=config.lr, betas=config.betas, eps=config.eps,
                weight_decay=config.weight_decay if adamw else 0.0)
        guarded = config.predicts and config.guard_threshold is not None
        self.guard = PredictionGuard(threshold=config.guard_threshold or 0.0) if guarded else None
        self.guard_group = dist.new_group(backend="gloo") if guarded else None
        self.weights = WeightSource(self.params, self.optimizer, lr_at=lr_at)
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []

    # --- transport ---------------------------------------------------------------------------
    def _send(self, tensor: torch.Tensor, dst: int) -> None:
        tensor = tensor.detach().contiguous()
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]
        self._pending.append((dist.isend(tensor, dst), tensor))

    def _recv(self, shape: tuple[int, ...], src: int) -> torch.Tensor:
        buf = torch.empty(shape)
        dist.recv(buf, src)
        return buf

    def _flush_sends(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()

    # --- the loop ----------------------------------------------------------------------------
    def train(self, batches: Batches, num_batches: int, batch_size: int,
              on_loss: Callable[[int, float], None] | None = None) -> AsyncResult:
        """Train on batches ``0 .. num_batches - 1`` of ``batch_size`` samples each;
        ``on_loss(batch, loss)`` is called on the last stage as each batch's loss is known."""
        cfg, p, k = self.config, self.p, self.k
        per = cfg.per_batch
        cuts = cfg.num_microbatches if per > 1 or self.guard is not None else 1  # flushed steps
        if batch_size % cuts:
            raise ValueError(f"batch_size {batch_size} must be a multiple of num_microbatches "
                             f"{cuts} (a flushed step cuts each batch into that many); change "
                             f"one of them")
        self.batch_size = batch_size
        if cfg.synchronous:
            actions = sync_1f1b(p, k, num_batches, per)
        elif cfg.weight_prediction == "2bw":
            actions = two_bw(p, k, num_batches * per, per)
        else:
            actions = async_1f1b(p, k, num_batches)
        stale = staleness(actions)
        # (first micro-batch, first batch, micro-batches per batch, synchronous) of each segment
        self.segments = [(0, 0, per, cfg.synchronous)]
        result = AsyncResult()
        self._in_flight: dict[int, tuple] = {}
        self._batches, self._loss_sum = lru_cache(maxsize=1)(batches), 0.0
        mode = cfg.weight_prediction
        dist.barrier()
        start = time.perf_counter()
        i = 0
        while i < len(actions):
            kind, j = actions[i]
            if kind == "F":
                self._forward(j, mode, stale.get(j, 0))
            elif kind == "U":
                self.weights.step()
            else:
                self._backward(j, result)
                if k == p - 1 and (j + 1) % self._segment(j)[2] == 0:
                    result.losses.append(self._loss_sum)
                    if on_loss is not None:
                        on_loss(len(result.losses) - 1, self._loss_sum)
                    self._loss_sum = 0.0
                if self._check_due(j, num_batches, result):
                    n_async = drain_point(p, j)
                    result.switched_at = n_async
                    actions = async_1f1b(p, k, n_async) + sync_1f1b(
                        p, k, num_batches - n_async, cfg.num_microbatches, first=n_async,
                        first_update=n_async)
                    self.segments.append((n_async, n_async, cfg.num_microbatches, True))
                    mode = "stash"
            i += 1
        self._flush_sends()
        dist.barrier()
        result.seconds = time.perf_counter() - start
        return result

    def _segment(self, j: int) -> tuple[int, int, int, bool]:
        return next(s for s in reversed(self.segments) if j >= s[0])

    def _micro_batch(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        first_mb, first_batch, per, _ = self._segment(j)
        batch = first_batch + (j - first_mb) // per
        micro = self.batch_size // per
        piece = slice((j - first_mb) % per * micro, ((j - first_mb) % per + 1) * micro)
        x, y = self._batches(batch)
        return x[piece], y[piece]

    def _forward(self, j: int, mode: str, steps: int) -> None:
        k, p = self.k, self.p
        sync = self._segment(j)[3]
        x, y = self._micro_batch(j)
        if k > 0:
            x = self._recv((len(y), *self.feature_shapes[k]), k - 1).requires_grad_()
        leaves = self.weights.for_forward("alias" if sync or mode == "none" else mode, steps)
        with self.forward_context():
            out = functional_call(self.stage, dict(zip(self.names, leaves, strict=True)), (x,))
            if k == p - 1:
                out = self.loss_fn(out, y) / self._segment(j)[2]
        if k == p - 1:
            self._loss_sum += float(out.detach())
        else:
            self._send(out, k + 1)
        forward_weights = None
        if self.guard is not None and not sync and mode in ("sgd", "adam"):
            forward_weights = [p.detach().clone() for p in self.params]
        self._in_flight[j] = (x, out, leaves, forward_weights)

    def _backward(self, j: int, result: AsyncResult) -> None:
        k, p = self.k, self.p
        x, out, leaves, forward_weights = self._in_flight.pop(j)
        if k == p - 1:
            torch.autograd.backward(out)
        else:
            torch.autograd.backward(out, self._recv(tuple(out.shape), k + 1))
        if k > 0:
            self._send(x.grad, k - 1)
        if forward_weights is not None and self.guard is not None:
            self.guard.observe([t.detach() for t in leaves], forward_weights, self.params)
        grads = self.weights.add_grads(leaves)
        if len(result.grads) < self.config.record_grads:
            result.grads.append([g.detach().clone() for g in grads])

    def _check_due(self, j: int, num_batches: int, result: AsyncResult) -> bool:
        """At a guard point (every rank reaches it after its B(j)): agree on the worst window
        mean and say whether to flush from here on."""
        guard, cfg = self.guard, self.config
        if guard is None or result.switched_at is not None or (j + 1) % cfg.guard_every:
            return False
        if drain_point(self.p, j) >= num_batches:
            return False
        worst = torch.tensor([guard.window_mean()], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=self.guard_group)
        result.guard_means.append(float(worst))
        if not guard.trips(float(worst)):
            return False
        if self.k == 0:
            log.warning("guard: mean prediction error ratio %.3f > %.3f after micro-batch %d; "
                        "flushing from batch %d on (synchronous 1F1B)", float(worst),
                        guard.threshold, j, drain_point(self.p, j))
        return True

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor, chunk: int = 256) -> float:
        """Accuracy of the current weights on ``(inputs, targets)`` (every rank returns it)."""
        k, p = self.k, self.p
        correct = torch.zeros(1, dtype=torch.float64)
        for start in range(0, len(targets), chunk):
            x, y = inputs[start:start + chunk], targets[start:start + chunk]
            if k > 0:
                x = self._recv((len(y), *self.feature_shapes[k]), k - 1)
            out = self.stage(x)
            if k < p - 1:
                self._send(out, k + 1)
            else:
                correct += (out.argmax(dim=-1) == y).sum()
        self._flush_sends()
        dist.broadcast(correct, src=p - 1)
        return float(correct) / len(targets)

