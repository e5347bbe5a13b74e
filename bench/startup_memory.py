"""Peak host memory per rank at start-up against the rank's share of the fp32 model state.

A GPT (8 blocks, width 1024: ~101 M parameters, ~403 MB of fp32 weights) is started under dp 8
with ZeRO-3 on 8 gloo CPU processes, so the whole state is 8x one rank's share. Each rank reports
its peak resident set (``VmHWM`` from /proc/self/status) once ``build_engine`` has returned
(optimizer state is allocated at the first step, so start-up holds weights only). Three jobs:

- ``baseline``: processes that import torch and meshmorph and join the process group, nothing
  else: the fixed cost of a process, subtracted to give the net figures.
- ``mesh``: the same plus the plan's DeviceMesh (its gloo sub-groups): the fixed cost of the job,
  a second, tighter baseline reported beside the first.
- ``meta``: ``build_engine`` as it runs (meta-device build, parallelize, ``materialize_``).
- ``host``: the old way, the whole chunk built in fp32 on the host and then sharded, for contrast.

Target: net peak <= 1.5x the rank's share of fp32 state for ``meta``.
Run: ``python bench/startup_memory.py [--world 8]``; writes bench/results/latest/startup_memory.json
(``--out PATH`` to choose, ``--update`` for the committed bench/results/startup_memory.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.helpers: the spawn harness

from tests.helpers.spawn import spawn  # noqa: E402

from results_path import Outputs, wrote  # noqa: E402

OUTPUTS = Outputs("bench/results/startup_memory.json")

SHAPE = dict(name="gpt-startup", arch="gpt", num_layers=8, hidden_size=1024, num_heads=16,
             vocab_size=256, seq_len=128)
"""The model: 8 blocks of 12.6 M parameters, tied 256-row vocabulary."""


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM), bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def job(rank: int, world_size: int, mode: str, out: str) -> None:
    import torch

    from meshmorph.run.config import OptimConfig
    from meshmorph.run.engine.train_engine import build_engine
    from meshmorph.spec.plan import Plan
    from meshmorph.spec.transformer import TransformerShape, build_transformer

    spec = build_transformer(TransformerShape(**SHAPE))  # type: ignore[arg-type]
    plan = Plan(model=spec.name, seq_len=spec.seq_len, dtype="fp32", dp=world_size, zero=3,
                global_batch=world_size).with_even_stages(spec)
    local_bytes = 0
    if mode == "mesh":
        from meshmorph.run.parallel.mesh import build_mesh

        build_mesh(plan, "cpu")
    if mode in ("meta", "host"):
        if mode == "host":  # the old start-up: every rank builds the whole chunk first
            import meshmorph.run.engine.train_engine as engine
            from meshmorph.run.model import decoder as models

            def whole_on_host(*args: object, **kwargs: object) -> models.Transformer:
                kwargs["device"] = "cpu"
                return models.build_chunk(*args, **kwargs)  # type: ignore[arg-type]

            engine.build_chunk = whole_on_host  # type: ignore[assignment]
        built = build_engine(spec, plan, OptimConfig(), seed=0, device=torch.device("cpu"))
        from torch.distributed.tensor import DTensor

        for part in built.model_parts:
            for param in part.parameters():
                local = param._local_tensor if isinstance(param, DTensor) else param
                local_bytes += local.numel() * local.element_size()
    Path(out, f"{mode}{rank}.json").write_text(json.dumps({
        "peak_rss_bytes": peak_rss_bytes(), "local_param_bytes": local_bytes,
        "state_bytes": spec.num_params * 4}))
    # no rank leaves (rank 0 holds the store) while another is still joining a mesh sub-group
    torch.distributed.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=8, help="ranks (dp degree, ZeRO-3)")
    OUTPUTS.add_args(parser)
    args = parser.parse_args()
    path = OUTPUTS.path(args)
    results: dict[str, object] = {"model": SHAPE, "world": args.world, "zero": 3}
    with tempfile.TemporaryDirectory() as out:
        runs: dict[str, list[dict[str, int]]] = {}
        for mode in ("baseline", "mesh", "meta", "host"):
            spawn(job, args.world, (mode, out), timeout_s=600, collective_timeout_s=300)
            runs[mode] = [json.loads(Path(out, f"{mode}{r}.json").read_text())
                          for r in range(args.world)]
    mib = 2**20
    baseline = statistics.median(r["peak_rss_bytes"] for r in runs["baseline"])
    state = runs["meta"][0]["state_bytes"]
    share = state / args.world
    with_mesh = statistics.median(r["peak_rss_bytes"] for r in runs["mesh"])
    results.update(state_bytes=state, share_bytes=share, baseline_peak_rss_bytes=baseline,
                   mesh_baseline_peak_rss_bytes=with_mesh)
    print(f"fp32 state {state / mib:.1f} MiB, share per rank {share / mib:.1f} MiB "
          f"(state = {state / share:.1f}x share); process baseline {baseline / mib:.1f} MiB, "
          f"with the device mesh {with_mesh / mib:.1f} MiB")
    for mode in ("meta", "host"):
        peaks = [r["peak_rss_bytes"] for r in runs[mode]]
        worst = max(peaks)
        net = worst - baseline
        results[mode] = {"peak_rss_bytes": peaks,
                         "local_param_bytes": [r["local_param_bytes"] for r in runs[mode]],
                         "raw_ratio": worst / share, "net_ratio": net / share,
                         "net_of_mesh_ratio": (worst - with_mesh) / share}
        print(f"{mode:>5}: worst rank peak {worst / mib:.1f} MiB raw = {worst / share:.2f}x share; "
              f"net of baseline {net / mib:.1f} MiB = {net / share:.2f}x share; "
              f"net of baseline with mesh {(worst - with_mesh) / mib:.1f} MiB = "
              f"{(worst - with_mesh) / share:.2f}x share")
    target = results["meta"]["net_ratio"] <= 1.5  # type: ignore[index]
    results["meets_target_net_1_5x"] = target
    print(f"target net <= 1.5x share: {'met' if target else 'NOT met'}")
    path.write_text(json.dumps(results, indent=2) + "\n")
    wrote(path)


if __name__ == "__main__":
    main()
