"""What a module's forward keeps for backward, measured: the distinct storages autograd saves
(``saved_tensors_hooks``), the module's input included, its parameters and autocast's 16-bit
copies of its weight matrices left out (the cost model counts those with the parameters), and on
CUDA the allocator's growth over the forward. A weight copy is told by its shape, so an
activation of a weight's shape (tokens equal to a width) is left out too: pick shapes unlike the
weights'."""

from __future__ import annotations

import torch


def saved_tensors(block: torch.nn.Module, x: torch.Tensor, dtype: torch.dtype) -> tuple[list, int]:
    """(saved tensors as [shape, dtype, bytes], allocator growth over the forward or -1)."""
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    weights = {tuple(p.shape) for p in block.parameters() if p.dim() == 2}
    weights |= {shape[::-1] for shape in weights}  # autocast's 16-bit weight copies (transposed)
    seen: dict[int, list] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key not in params and key not in seen and tuple(t.shape) not in weights:
            seen[key] = [list(t.shape), str(t.dtype).removeprefix("torch."),
                         t.untyped_storage().nbytes()]
        return t

    cuda = x.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    before = torch.cuda.memory_allocated() if cuda else 0
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast(x.device.type, dtype=dtype, enabled=dtype != torch.float32):
        out = block(x)
    grown = (torch.cuda.memory_allocated() - before - out.untyped_storage().nbytes()) if cuda \
        else -1
    out.float().sum().backward()
    return list(seen.values()), grown
