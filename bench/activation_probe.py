"""What one decoder block of meshmorph's runtime keeps for backward, beside what the cost model
says it keeps: the physics behind the activation term of the peak-memory prediction.

For each model, one micro-batch of b sequences runs forward through one ``Block`` (input in the
residual stream's dtype: fp32 under autocast, as the engine's embedding hands it on) eagerly and,
on CUDA, compiled by inductor; the block's saved tensors are listed (``saved_tensors_hooks``,
one entry per storage: shape, dtype, bytes; the block's input included, autocast's 16-bit weight
copies left out: the cost model counts those with the parameters) and the allocator's growth over the forward is read
(CUDA). Beside them: the ModelSpec's fused ``activation[none]`` bytes for the same tokens, and
what the cost model predicts for the block run that way (``Plan.compile``, ``LayerSpec.runtime``).
On the CPU, ``F.rms_norm`` runs decomposed and also keeps each normalized fp32 output (a llama
block 8h bytes per token above the prediction, which follows the fused CUDA kernel).

    PYTHONPATH=src python bench/activation_probe.py [--device cpu] [--out PATH | --update]

Writes bench/results/latest/activation_probe.json (``--out PATH`` to choose, ``--update`` for the
committed bench/results/activation_probe.json).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from meshmorph.cost.model import CostModel  # noqa: E402
from meshmorph.run.model.decoder import Block  # noqa: E402
from meshmorph.run.model.saved import saved_tensors  # noqa: E402
from meshmorph.spec import load_model, parse_cluster  # noqa: E402
from meshmorph.spec.model import Recompute  # noqa: E402
from meshmorph.spec.plan import Plan  # noqa: E402
from results_path import Outputs, wrote  # noqa: E402

OUTPUTS = Outputs("bench/results/activation_probe.json")


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
    cost = CostModel(spec, parse_cluster("h200:1x1"))  # activation bytes: any GPU will do
    cases = [("eager", block)]
    if compile_too:
        cases.append(("compile", torch.compile(block, dynamic=False)))
    for mode, module in cases:
        for _ in range(2 if mode == "compile" else 1):  # the first compiled call compiles
            saved, grown = saved_tensors(module, x, dtype)
        total = sum(entry[2] for entry in saved)
        plan = Plan(model=name, seq_len=seq, global_batch=b, micro_batch=b,
                    dtype="fp32" if dtype == torch.float32 else "bf16", compile=mode == "compile")
        predicted = cost.coster(plan).layer(1, cost.default_gpu(), b, 1, False,
                                            Recompute.NONE).activation_bytes
        row[mode] = {"saved": saved, "saved_bytes": total, "allocated_growth_bytes": grown,
                     "predicted_bytes": predicted,
                     "saved_per_token_per_h": total / tokens / spec.hidden_size,
                     "growth_per_token_per_h": grown / tokens / spec.hidden_size
                     if grown >= 0 else None}
        print(f"{name:12s} {mode:7s} saved {total / 2**20:9.1f} MiB "
              f"({total / tokens / spec.hidden_size:5.1f} h bytes/token)"
              + (f", allocator +{grown / 2**20:9.1f} MiB "
                 f"({grown / tokens / spec.hidden_size:5.1f} h)" if grown >= 0 else "")
              + f"; predicted {predicted / tokens / spec.hidden_size:5.1f} h (fused "
              f"{row['predicted_fused_bytes'] / tokens / spec.hidden_size:.1f} h)",
              flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", nargs="+", default=None)
    OUTPUTS.add_args(parser)
    args = parser.parse_args(argv)
    out = OUTPUTS.path(args)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    models = args.models or (["gpt3-1.3b", "llama3.2-1b"] if cuda else ["gpt-tiny", "llama-tiny"])
    rows = [probe(m, device, torch.bfloat16, 4 if cuda else 2, 2048 if cuda else 64, cuda)
            for m in models]
    out.write_text(json.dumps({"device": str(device), "torch": torch.__version__, "rows": rows},
                              indent=1))
    wrote(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
