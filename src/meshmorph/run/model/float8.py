"""Float8 linear layers (dtype ``fp8``): every ``nn.Linear`` of the chunk's transformer blocks
becomes torchao's ``Float8Linear`` with the plan's recipe (``Plan.fp8_scaling``), as torchtitan
converts a model before it parallelizes it; the embedding and the output head stay 16-bit, as the
cost model prices them (cost/fp8.py).

``Float8Linear`` is an ``nn.Linear`` with the same parameters under the same names, so tensor
parallelism's styles, FSDP2, DDP, recompute, meta-device materialisation, checkpoints and the
reshape Layout see the model they see in bf16; only the three GEMMs of each block linear scale
and cast their operands to float8 on the fly (``torch._scaled_mm``, which torch's CPU build has
too). Gathers and tensor-parallel collectives stay 16-bit (no float8 all-gather, plain TP
styles), as the cost model prices them.

Precision as the runtime sets it: under ``torch.autocast`` torchao casts a linear's input to the
autocast dtype only when CUDA's autocast is on (``torch.get_autocast_gpu_dtype``); on CPU the
input would stay fp32 and ``rowwise_with_gw_hp``'s high-precision weight-gradient GEMM would
multiply a bf16 gradient by an fp32 input (``expected m1 and m2 to have the same dtype, but got:
c10::BFloat16 != float``). A forward pre-hook (``cast_inputs_under_autocast_``, added after
tensor parallelism's own input hooks) casts the input to the autocast dtype of its device, so
every recipe runs on CPU as torchao runs it on CUDA. Under FSDP2's ``MixedPrecisionPolicy``
(bf16 parameters and inputs, no autocast) the hook does nothing.

torch's plain ``ColwiseParallel``/``RowwiseParallel`` split a float8 linear as they split an
``nn.Linear`` (torchtitan's choice for the rowwise recipes): DTensor then all-reduces the absolute
maxima of scales whose reduction runs along a split dim (cost/fp8.py's ``tp_amax_elements``).
torchao's ``Float8ColwiseParallel``/``Float8RowwiseParallel`` (torchtitan's for tensorwise) would
all-gather float8 activations under sequence parallelism, which gloo refuses (``Invalid scalar
type``: it has no float8 dtype) and which the cost model does not price, so they are not used.

torchao is imported here only, and only for a plan in dtype fp8: the planning packages never
import it (nor torch).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from meshmorph.spec.plan import Plan

BLOCKS_PREFIX = "blocks."
"""Names of a chunk's transformer blocks (run/model/decoder.py): the linears converted lie
below it; ``embed`` and ``head`` do not."""

QUIET_LOGGERS = ("torchao", "torch.utils._pytree")
"""Loggers whose warnings importing torchao prints on a CPU build: ``Failed to load
.../torchao/_C_*.so`` for each CUDA kernel library (``_C_cutlass_90a``, ``_C_mxfp8``, ...), and
pytree's note on an Enum torchao registers.
Raised to ERROR around the import only: an ImportError still raises, errors still print."""


@contextlib.contextmanager
def _quiet(loggers: tuple[str, ...] = QUIET_LOGGERS) -> Iterator[None]:
    """Within it, ``loggers`` print errors only; their levels are restored afterwards."""
    saved = [(logging.getLogger(name), logging.getLogger(name).level) for name in loggers]
    for logger, _ in saved:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in saved:
            logger.setLevel(level)


def torchao_float8() -> Any:
    """``torchao.float8``, imported without the CUDA-kernel noise of a CPU build; a clear error
    when torchao is not installed."""
    try:
        with _quiet():
            import torchao.float8 as float8
    except ImportError as exc:
        raise ImportError(f"dtype fp8 runs torchao's float8 training, and torchao does not "
                          f"import ({exc}); install it with pip install 'meshmorph[run]' (or "
                          f"pip install torchao), or run dtype bf16") from exc
    return float8


def float8_config(recipe: str) -> Any:
    """torchao's ``Float8LinearConfig`` of recipe ``recipe`` (``tensorwise``, ``rowwise`` or
    ``rowwise_with_gw_hp``: ``Plan.fp8_scaling``, named as torchao names them)."""
    return torchao_float8().Float8LinearConfig.from_recipe_name(str(recipe))


def is_block_linear(module: nn.Module, name: str) -> bool:
    """Whether ``module`` (named ``name`` in a chunk) is a linear layer of a transformer block."""
    return isinstance(module, nn.Linear) and name.startswith(BLOCKS_PREFIX)


def _input_to_autocast_dtype(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """Forward pre-hook: a float8 linear's input in the autocast dtype of its device, where
    autocast is on there (torchao does it for CUDA only)."""
    x = args[0]
    kind = x.device.type
    if not torch.is_autocast_enabled(kind):
        return None
    dtype = torch.get_autocast_dtype(kind)
    return None if x.dtype == dtype else (x.to(dtype), *args[1:])


def convert_blocks_to_float8_(chunk: nn.Module, recipe: str) -> list[str]:
    """Swap every linear layer of ``chunk``'s transformer blocks for torchao's ``Float8Linear``
    with ``recipe``, in place, before any parallelism (the parameters keep their objects and
    names: a chunk on the meta device stays there); returns the converted layers' names."""
    config = float8_config(recipe)
    names = [name for name, module in chunk.named_modules() if is_block_linear(module, name)]
    torchao_float8().convert_to_float8_training(chunk, config=config,
                                                module_filter_fn=is_block_linear)
    return names


def cast_inputs_under_autocast_(chunk: nn.Module) -> None:
    """Give every float8 linear of ``chunk`` the pre-hook that casts its input to its device's
    autocast dtype (the module docstring). Call it after tensor parallelism: forward pre-hooks
    run in the order they were registered, so the cast then falls after TP's input hook, on the
    DTensor, where autocast casts an ``nn.Linear``'s input; the input-gradient collective stays
    in the dtype of the residual stream (fp32 under autocast), as in bf16 and as the cost model
    prices it."""
    float8_linear = torchao_float8().float8_linear.Float8Linear
    for module in chunk.modules():
        if isinstance(module, float8_linear):
            module.register_forward_pre_hook(_input_to_autocast_dtype)


def check_float8_device(device: torch.device) -> None:
    """Refuse a CUDA device without float8 tensor cores (compute capability below 8.9), where
    torch's scaled GEMM does not run; a CPU runs it (torch's CPU kernel)."""
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        raise RuntimeError(f"dtype fp8: torch's float8 GEMM needs float8 tensor cores (compute "
                           f"capability 8.9 or newer: L4, H100, H200), and this GPU has "
                           f"{capability[0]}.{capability[1]}; run dtype bf16")


def convert_for_plan_(chunk: nn.Module, plan: Plan) -> list[str]:
    """``convert_blocks_to_float8_`` with the plan's recipe where the plan's dtype is fp8; no
    change otherwise. Returns the converted layers' names."""
    if plan.dtype != "fp8":
        return []
    return convert_blocks_to_float8_(chunk, plan.fp8_scaling)
