"""FSDP2 layers of a layerwise chunk under a split-backward pipeline (zb, zbv, dualpipev).

torch pipelining's zero-bubble schedules split each micro-batch's backward into the
input-gradient pass (I: ``torch.autograd.grad`` on the stage inputs) and a later weight-gradient
pass (W: ``autograd.grad`` on the parameters, accumulated into ``.grad``). It defers FSDP2's
reduction only for a stage module that is itself an ``FSDPModule``; a layerwise chunk instead
shards each ZeRO-2 layer on its own dp group (run/parallel/layerwise_parallelize.py), and each such
layer's post-backward hook fires when the gradient reaches the layer's input, in the I pass,
before the W pass has written the weight gradients. Left alone, FSDP2 would reduce-scatter the
earlier micro-batches' gradients and leave the last one's unreduced.

So, for the step: every ZeRO-2 layer accumulates without reducing (``hold_reduction``), and
after the schedule (every W pass done) ``reduce_held`` runs each layer's post-backward once with
its reduce-scatter on, as torch's own ``perform_reduce_grad`` does for a whole-stage FSDPModule:
one reduce-scatter per layer and step, in the plan's ``reduce_dtype``. The gathered parameters
stay registered from the first forward to the step's end (ZeRO-2), so the W pass finds the
parameters the I pass recorded.

ZeRO-3 layers (resharded after forward) are refused under these schedules
(spec/runnable.py): the I pass records the sharded parameters, not the gathered ones
the graph used, and their gradients would be lost.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch.distributed.fsdp import FSDPModule, fully_shard


def hold_reduction(modules: Iterable[FSDPModule]) -> None:
    """Accumulate gradients on the gathered parameters over the step, no reduction (ZeRO-2)."""
    for module in modules:
        module.set_is_last_backward(False)
        module.set_reshard_after_backward(False)
        module.set_requires_gradient_sync(False)


def reduce_held(modules: Iterable[FSDPModule]) -> None:
    """Reduce-scatter every layer's accumulated gradients once over its dp group (after the last
    weight-gradient pass); the gathered parameters stay to the step's end."""
    for module in modules:
        module.set_is_last_backward(True)
        module.set_requires_gradient_sync(True)
        state = fully_shard.state(module)  # type: ignore[attr-defined]
        for inner in state._state_ctx.all_states:
            for group in inner._fsdp_param_groups:
                group.post_backward()
        state._root_post_backward_final_callback()
