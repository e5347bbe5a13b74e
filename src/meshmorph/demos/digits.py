"""scikit-learn's bundled handwritten digits (8x8 images, 10 classes) trained by a 4-stage MLP
pipeline under every mode of the asynchronous executor; run under torchrun:

    torchrun --nproc_per_node 4 -m meshmorph.demos.digits --modes sync stale predict_sgd

Rank 0 prints one line per (mode, seed) and, with ``--out``, writes them as JSON. The data:
``load_digits`` scaled to [0, 1], a stratified 80/20 split (fixed), batches drawn from a new
permutation of the training set each epoch (seeded). Stage ``k`` of the model is built from its
own seed, so any number of processes (or one, in the tests' reference) builds the same weights.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshmorph.run.async_pipe.config import AsyncPipelineConfig
from meshmorph.run.async_pipe.executor import AsyncPipeline

HIDDEN = 128
"""Width of the hidden layers."""

MODES: dict[str, AsyncPipelineConfig] = {
    "sync": AsyncPipelineConfig(synchronous=True, optimizer="sgd"),
    "stale": AsyncPipelineConfig(weight_prediction="none", optimizer="sgd"),
    "stash": AsyncPipelineConfig(weight_prediction="stash", optimizer="sgd"),
    "2bw": AsyncPipelineConfig(weight_prediction="2bw", optimizer="sgd"),
    "predict_sgd": AsyncPipelineConfig(weight_prediction="sgd", optimizer="sgd"),
    "sync_adam": AsyncPipelineConfig(synchronous=True, optimizer="adam"),
    "stale_adam": AsyncPipelineConfig(weight_prediction="none", optimizer="adam"),
    "predict_adam": AsyncPipelineConfig(weight_prediction="adam", optimizer="adam"),
}
"""The modes the benchmark compares, by name (learning rates set by ``--lr`` / ``--adam-lr``)."""


def digits(device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train inputs, train labels, test inputs, test labels): 1,437 and 360 samples."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x / 16.0, y, test_size=0.2, random_state=0,
                                              stratify=y)
    as_x = lambda a: torch.tensor(a, dtype=torch.float32, device=device)  # noqa: E731
    as_y = lambda a: torch.tensor(a, dtype=torch.long, device=device)  # noqa: E731
    return as_x(x_tr), as_y(y_tr), as_x(x_te), as_y(y_te)


def feature_shapes(stages: int = 4) -> list[tuple[int, ...]]:
    """Shape of one sample entering each stage."""
    return [(64,)] + [(HIDDEN,)] * (stages - 1)


def build_stage(k: int, stages: int, seed: int) -> nn.Module:
    """Stage ``k`` of the MLP 64 -> 128 -> ... -> 10 (one Linear per stage, ReLU between)."""
    torch.manual_seed(seed * 1000 + k)
    width_in = 64 if k == 0 else HIDDEN
    if k == stages - 1:
        return nn.Linear(width_in, 10)
    return nn.Sequential(nn.Linear(width_in, HIDDEN), nn.ReLU())


def batch_source(x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int):  # type: ignore[no-untyped-def]
    """Batch index -> (inputs, labels): epoch ``e`` is a permutation seeded by (seed, e); the
    last partial batch of an epoch is dropped."""
    per_epoch = len(y) // batch_size

    def batch(index: int) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, within = divmod(index, per_epoch)
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed * 7919 + epoch))
        take = order[within * batch_size:(within + 1) * batch_size]
        return x[take], y[take]

    return batch


def train_one(config: AsyncPipelineConfig, *, seed: int, steps: int, batch_size: int
              ) -> dict[str, float | int | None]:
    """Train and test one mode on this rank's stage; every rank returns the same figures."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x_tr, y_tr, x_te, y_te = digits()
    pipe = AsyncPipeline(build_stage(rank, world, seed), config,
                         feature_shapes=feature_shapes(world), loss_fn=F.cross_entropy)
    result = pipe.train(batch_source(x_tr, y_tr, batch_size, seed), steps, batch_size)
    accuracy = pipe.evaluate(x_te, y_te)
    tail = torch.tensor([sum(result.losses[-20:]) / max(1, len(result.losses[-20:]))])
    dist.broadcast(tail, src=world - 1)
    checks = result.guard_means  # worst stage's window mean at each guard check
    return {"accuracy": accuracy, "steps_per_s": steps / result.seconds,
            "final_loss": float(tail), "switched_at": result.switched_at,
            "guard_ratio_median": sorted(checks)[len(checks) // 2] if checks else None,
            "guard_ratio_max": max(checks) if checks else None}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps (batches)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05, help="momentum-SGD learning rate")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--adam-lr", type=float, default=3e-3, help="Adam learning rate")
    parser.add_argument("--adam-steps", type=int, default=None,
                        help="optimizer steps of the Adam modes (default: --steps)")
    parser.add_argument("--guard", type=float, default=1.0,
                        help="guard threshold on the prediction error ratio (<0: off)")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rows = []
    for name in args.modes:
        config = replace(MODES[name], momentum=args.momentum,
                         lr=args.adam_lr if MODES[name].optimizer == "adam" else args.lr,
                         guard_threshold=None if args.guard < 0 else args.guard)
        steps = args.adam_steps if config.optimizer == "adam" and args.adam_steps else args.steps
        for seed in args.seeds:
            row = {"mode": name, "seed": seed, "steps": steps,
                   **train_one(config, seed=seed, steps=steps, batch_size=args.batch_size)}
            rows.append(row)
            if dist.get_rank() == 0:
                print(f"{name:13s} seed {seed}  accuracy {row['accuracy']:.4f}  "
                      f"loss {row['final_loss']:.4f}  {row['steps_per_s']:.0f} steps/s"
                      + (f"  (flushing from batch {row['switched_at']})"
                         if row["switched_at"] is not None else ""), flush=True)
    if dist.get_rank() == 0 and args.out is not None:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                        "rows": rows}, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
