"""Optional ``torch.compile`` of each transformer block (``[train] compile = true``).

Each block's ``forward`` is compiled on the instance, after tensor parallelism, recompute and
data parallelism were applied (torchtitan's order: the checkpoint a recompute mode installed is
traced inside the compiled region; FSDP2's and DDP's hooks stay outside it, on the module). The
embedding, the head and the loss stay eager. Parameter names do not change, so checkpoints of a
compiled run and of an eager one are interchangeable.

Backends: ``inductor`` (generated kernels; on CPU it needs a C++ compiler), ``aot_eager`` (the
same graphs run by eager kernels: checks that a model compiles, no speed-up) and ``eager``
(dynamo only). When ``inductor`` is asked for on a CPU without a C++ compiler, ``aot_eager`` runs
instead and ``resolve_backend`` says so.

A plan with ``tp_comm_overlap`` runs torch's async tensor parallel (torchtitan's
``enable_async_tensor_parallel``): inductor's micro-pipelined TP pass splits each sequence-parallel
all-gather and reduce-scatter beside the GEMM it feeds into chunks over CUDA symmetric memory.
It is a pass of inductor over the compiled blocks, so it needs CUDA ranks (spec/runnable.py
refuses it elsewhere) and the ``inductor`` backend.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

BACKENDS = ("inductor", "aot_eager", "eager")
"""``torch.compile`` backends a job may name."""


@dataclass(frozen=True, slots=True)
class CompileChoice:
    """What ``resolve_backend`` decided."""

    backend: str
    """The backend the blocks are compiled with."""
    note: str | None
    """Why it differs from the one asked for (None when it does not)."""


def cpp_compiler() -> str | None:
    """The C++ compiler inductor would call on CPU, if one is on the PATH."""
    from torch._inductor import config as inductor_config

    configured = inductor_config.cpp.cxx
    names = [c for c in (configured if isinstance(configured, tuple) else (configured,)) if c]
    for name in [*names, "g++", "c++", "clang++"]:
        found = shutil.which(name)
        if found:
            return found
    return None


def resolve_backend(requested: str, device: torch.device, *,
                    async_tp: bool = False) -> CompileChoice:
    """The backend to compile with on ``device``: ``requested``, or ``aot_eager`` with a note
    when inductor cannot build CPU kernels here. ``async_tp``: the plan's ``tp_comm_overlap``,
    an inductor pass (any other backend is refused)."""
    if requested not in BACKENDS:
        raise ValueError(f"[train] compile_backend must be one of {', '.join(BACKENDS)}, got "
                         f"{requested!r}")
    if async_tp and requested != "inductor":
        raise ValueError(f"tp_comm_overlap runs as inductor's micro-pipelined tensor parallel, "
                         f"not under [train] compile_backend {requested!r}; set "
                         f"compile_backend = \"inductor\", or tp_comm_overlap false in the plan")
    if requested == "inductor" and device.type == "cpu" and cpp_compiler() is None:
        return CompileChoice("aot_eager", "torch.compile: no C++ compiler on the PATH for "
                             "inductor's CPU kernels; compiling with backend aot_eager instead "
                             "(install g++ for inductor, or set [train] compile_backend)")
    return CompileChoice(requested, None)


def compile_blocks(parts: list[nn.Module], backend: str, *, async_tp: bool = False) -> int:
    """Compile the ``forward`` of every block of every model part in place; returns how many.
    ``async_tp``: with inductor's micro-pipelined tensor parallel pass on (it is read when a
    block first compiles).

    ``parts`` are run/models.Transformer chunks (their ``blocks`` ModuleDict)."""
    if async_tp:
        from torch._inductor import config as inductor_config

        inductor_config._micro_pipeline_tp = True
    count = 0
    for part in parts:
        blocks = getattr(part, "blocks", None)
        if blocks is None:
            continue
        for block in blocks.values():
            block.forward = _compiled(block.forward, backend)  # type: ignore[method-assign]
            count += 1
    return count


def _compiled(inner: Callable[..., Any], backend: str) -> Callable[..., Any]:
    """``inner`` compiled (dynamic=False: every micro-batch has the same shape, one graph per
    block), run eagerly while a Python dispatch mode is active: the first step counts its
    collectives under one (run/engine/comm_count.py), and dynamo, meeting a frame under a dispatch
    mode, would skip that code object from then on, compiled or not."""
    compiled = torch.compile(inner, backend=backend, dynamic=False)

    def forward(*args: Any, **kwargs: Any) -> Any:
        if _get_current_dispatch_mode() is not None:
            return inner(*args, **kwargs)
        return compiled(*args, **kwargs)

    return forward
