"""Where a measured training step's time goes, phase by phase, for ``meshmorph validate``.

``StepPhases`` hooks into a built ``TrainEngine`` from outside (module hooks, gradient hooks,
optimizer step hooks; nothing in the engine changes) and splits each timed step into:

- ``forward_s``: the runners' forward calls, summed over the step's micro-batches;
- ``backward_s``: the rest of the forward-and-backward phase up to the last gradient computed
  on this rank (pipelines: with their sends, receives and bubble);
- ``grad_reduce_wait_s``: from the last gradient computed to the end of the backward phase:
  what DDP's reducer waits for its bucketed all-reduces after the backward's compute ends
  (0 where no gradient hook fires, as under FSDP2, whose reduce-scatters stay in
  ``backward_s``);
- ``optimizer_s``: the optimizers' ``step()`` (ZeRO-1: its parameter all-gather included);
- ``tail_other_s``: the rest of the step after the backward phase: the gradient norm and its
  all-reduce, clipping, the LR schedule, the loss all-reduce (a wait for the slowest rank);
- ``step_s``, and the process CPU time of the backward phase and of the tail
  (``fwd_bwd_cpu_s``, ``tail_cpu_s``): CPU time well below wall time is time spent waiting.
"""

from __future__ import annotations

import time
from typing import Any

PHASES = ("forward_s", "backward_s", "grad_reduce_wait_s", "optimizer_s", "tail_other_s",
          "step_s", "fwd_bwd_cpu_s", "tail_cpu_s")
"""The keys of one step's record, in order."""


class StepPhases:
    """Phase clocks around ``engine``'s steps: ``begin()`` before a step, ``end()`` after it
    (returns the step's record, keys ``PHASES``); ``records`` holds every ended step."""

    def __init__(self, engine: Any) -> None:
        self.records: list[dict[str, float]] = []
        self._forward = 0.0
        self._fwd_start = 0.0
        self._last_grad = 0.0
        self._opt = 0.0
        self._opt_start = 0.0
        self._opt_depth = 0
        self._fb_end = (0.0, 0.0)
        self._handles: list[Any] = []
        for runner in engine._runners:
            self._handles.append(runner.register_forward_pre_hook(self._pre_forward))
            self._handles.append(runner.register_forward_hook(self._post_forward))
        for params in engine._params:
            for param in params:
                if param.requires_grad:
                    self._handles.append(param.register_post_accumulate_grad_hook(self._grad))
        for opt in engine.optimizers:
            self._handles.append(opt.register_step_pre_hook(self._pre_step))
            self._handles.append(opt.register_step_post_hook(self._post_step))
        inner = engine._forward_backward

        def forward_backward(tokens: Any) -> Any:
            out = inner(tokens)
            self._fb_end = (time.perf_counter(), time.process_time())
            return out

        engine._forward_backward = forward_backward
        self._start = (0.0, 0.0)

    def _pre_forward(self, *_: Any) -> None:
        self._fwd_start = time.perf_counter()

    def _post_forward(self, *_: Any) -> None:
        self._forward += time.perf_counter() - self._fwd_start

    def _grad(self, *_: Any) -> None:
        self._last_grad = time.perf_counter()

    def _pre_step(self, *_: Any) -> None:
        # torch hooks each class's step() once it is instantiated: an optimizer whose step()
        # calls a parent's hooked step() fires the hooks again inside; the outermost pair counts
        if self._opt_depth == 0:
            self._opt_start = time.perf_counter()
        self._opt_depth += 1

    def _post_step(self, *_: Any) -> None:
        self._opt_depth -= 1
        if self._opt_depth == 0:
            self._opt += time.perf_counter() - self._opt_start

    def begin(self) -> None:
        """Start the clocks of one step."""
        self._forward = self._opt = self._last_grad = 0.0
        self._start = (time.perf_counter(), time.process_time())

    def end(self) -> dict[str, float]:
        """Stop the clocks; the step's record (also appended to ``records``)."""
        wall, cpu = time.perf_counter(), time.process_time()
        (t0, c0), (t1, c1) = self._start, self._fb_end
        last = self._last_grad if t0 < self._last_grad <= t1 else t1
        tail = wall - t1
        record = {"forward_s": self._forward,
                  "backward_s": max(last - t0 - self._forward, 0.0),
                  "grad_reduce_wait_s": t1 - last,
                  "optimizer_s": self._opt,
                  "tail_other_s": max(tail - self._opt, 0.0),
                  "step_s": wall - t0,
                  "fwd_bwd_cpu_s": c1 - c0,
                  "tail_cpu_s": cpu - c1}
        self.records.append(record)
        return record

    def close(self) -> None:
        """Remove every hook."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
