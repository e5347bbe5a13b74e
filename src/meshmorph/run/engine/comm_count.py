"""Bytes this rank sends per collective kind, counted by intercepting torch's collective ops.

A ``TorchDispatchMode`` sees every c10d op (``c10d.allreduce_``, ``c10d._allgather_base_``, ...:
what ``torch.distributed``'s functions, DDP's comm hooks, FSDP2 and pipelining call) and every
functional collective (``_c10d_functional.*``: what DTensor redistributions call). The op list is
the one ``torch.distributed.tensor.debug.CommDebugMode`` uses, and like it the mode lets DTensor
desugar an op first, so collectives issued inside a DTensor op (``loss_parallel``'s reductions)
are counted too.

"Sent" is defined once, here, and the cost model predicts the same quantity (cost/rank_state.py):
the bytes of the collective's input buffer on this rank. An all-reduce sends its whole tensor, an
all-gather its shard (the padded shard, as FSDP2 and DTensor pad uneven dim-0 shards), a
reduce-scatter its whole input, a broadcast its tensor (on every rank of the group), a
point-to-point transfer the tensors it sends (a receive sends nothing).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

COMM_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv", "broadcast")
"""The kinds of the state line's ``comm_bytes`` dict."""

_KIND_OF_OP: dict[str, str] = {
    # c10d ops (process-group calls)
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "reduce_": "all_reduce",
    "_allgather_base_": "all_gather", "allgather_": "all_gather",
    "allgather_coalesced_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "broadcast_": "broadcast", "send": "send_recv", "recv_": None,  # type: ignore[dict-item]
    "recv_any_source_": None,  # type: ignore[dict-item]
    "alltoall_": "all_to_all", "alltoall_base_": "all_to_all",
    "gather_": "gather", "scatter_": "scatter",
    # functional collectives (DTensor)
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all", "broadcast": "broadcast",
}

# c10d ops whose first argument is the output and second the input
_OUTPUT_FIRST = {"_allgather_base_", "allgather_", "allgather_coalesced_",
                 "allgather_into_tensor_coalesced_", "_reduce_scatter_base_", "reduce_scatter_",
                 "reduce_scatter_tensor_coalesced_", "alltoall_", "alltoall_base_"}

_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd")


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(_nbytes(v) for v in value)
    return 0


class CommCounter(TorchDispatchMode):
    """Sums the input bytes of every collective op that runs under it, by kind."""

    def __init__(self) -> None:
        super().__init__()
        self.sent_bytes: dict[str, int] = dict.fromkeys(COMM_KINDS, 0)
        """Bytes sent by kind (COMM_KINDS, plus any other kind that ran)."""
        self.calls: dict[str, int] = dict.fromkeys(COMM_KINDS, 0)
        """Collective calls by kind."""
        self.log: list[tuple[str, str, int]] = []
        """(kind, op name, bytes sent) of every call, in order."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        if any(t is DTensor for t in types):
            # let DTensor desugar the op first (as CommDebugMode does): the collectives it issues
            # inside an op (loss_parallel's reductions, implicit redistributions) then come back
            # through this mode on plain tensors
            return NotImplemented
        namespace = func.namespace
        if namespace in _NAMESPACES:
            name = func._schema.name.split("::")[-1]
            kind = _KIND_OF_OP.get(name)
            if kind is not None:
                payload = args[1] if namespace == "c10d" and name in _OUTPUT_FIRST else args[0]
                self.sent_bytes[kind] = self.sent_bytes.get(kind, 0) + _nbytes(payload)
                self.calls[kind] = self.calls.get(kind, 0) + 1
                self.log.append((kind, name, _nbytes(payload)))
        return func(*args, **(kwargs or {}))
