"""What one decoder block of meshmorph's runtime keeps for backward, beside what the cost model
says it keeps: the physics behind the activation term of the peak-memory prediction.

For each model, one micro-batch of b sequences runs forward through one ``Block`` (input in the
residual stream's dtype: fp32 under autocast, as the engine's embedding hands it on) eagerly and,
on CUDA, compiled by inductor; the block's saved tensors are listed (``saved_tensors_hooks``,
one entry per storage: shape, dtype, bytes; the block's input included, autocast's 16-bit weight
copies left out: the cost model counts those with the parameters) and the allocator's growth over the forward is read
(CUDA). Beside them: the ModelSpec's ``activation[none]`` bytes for the same tokens, and its
eager extra (``LayerSpec.eager_activation_extra``).

    PYTHONPATH=src python bench/activation_probe.py [--device cpu] [--out PATH]

Writes ``bench/results/activation_probe.json`` only with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from meshmorph.run.model.decoder import Block  # noqa: E402
from meshmorph.spec import load_model  # noqa: E402
from meshmorph.spec.model import Recompute  # noqa: E402


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


def probe(name: str, device: torch.device, dtype: torch.dtype, b: int, seq: int,
          compile_too: bool) -> dict[str, Any]:
    spec = load_model(name, seq)
    layer = spec.layers[1]
    tokens = b * seq
    scale = 2.0 if dtype == torch.float32 else 1.0
    with torch.device(device):
        block = Block(spec)
    x = torch.randn(b, seq, spec.hidden_size, device=device, requires_grad=True)
    row: dict[str, Any] = {"model": name, "b": b, "seq": seq, "dtype": str(dtype),
                           "hidden": spec.hidden_size, "tokens": tokens}
    act = layer.activation[Recompute.NONE]
    row["predicted_fused_bytes"] = (act.shared + act.split) * tokens * scale
    extra = getattr(layer, "eager_activation_extra", None)
    if extra is not None:
        row["predicted_eager_extra_bytes"] = extra * tokens * scale
    cases = [("eager", block)]
    if compile_too:
        cases.append(("compile", torch.compile(block, dynamic=False)))
    for mode, module in cases:
        for _ in range(2 if mode == "compile" else 1):  # the first compiled call compiles
            saved, grown = saved_tensors(module, x, dtype)
        total = sum(entry[2] for entry in saved)
        row[mode] = {"saved": saved, "saved_bytes": total, "allocated_growth_bytes": grown,
                     "saved_per_token_per_h": total / tokens / spec.hidden_size,
                     "growth_per_token_per_h": grown / tokens / spec.hidden_size
                     if grown >= 0 else None}
        print(f"{name:12s} {mode:7s} saved {total / 2**20:9.1f} MiB "
              f"({total / tokens / spec.hidden_size:5.1f} h bytes/token)"
              + (f", allocator +{grown / 2**20:9.1f} MiB "
                 f"({grown / tokens / spec.hidden_size:5.1f} h)" if grown >= 0 else "")
              + f"; predicted fused {row['predicted_fused_bytes'] / tokens / spec.hidden_size:5.1f} h",
              flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", nargs="+", default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    models = args.models or (["gpt3-1.3b", "llama3.2-1b"] if cuda else ["gpt-tiny", "llama-tiny"])
    rows = [probe(m, device, torch.bfloat16, 4 if cuda else 2, 2048 if cuda else 64, cuda)
            for m in models]
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": str(device), "torch": torch.__version__,
                                        "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
