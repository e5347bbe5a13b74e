"""Asynchronous pipeline training in about a minute on a laptop: scikit-learn's digits through a
4-stage MLP on 4 gloo processes, synchronous 1F1B against stale weights against SpecTrain's
weight prediction (same seed, same 400 steps of 32 samples):

    torchrun --nproc_per_node 4 examples/async_pipeline.py
    torchrun --nproc_per_node 4 examples/async_pipeline.py --modes stash 2bw --steps 200

Each rank holds one stage (``build_stage``); ``AsyncPipeline`` runs it under a config and rank 0
prints test accuracy and steps/s per mode. Momentum SGD at lr 0.015 (momentum 0.9) is where
staleness hurts: stage 0 computes with weights 3 updates old.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshmorph.demos.digits import batch_source, build_stage, digits, feature_shapes
from meshmorph.run.async_pipe.config import AsyncPipelineConfig
from meshmorph.run.async_pipe.executor import AsyncPipeline

CONFIGS = {
    "sync": dict(synchronous=True),  # 1F1B with a flush per step: the reference
    "stale": dict(weight_prediction="none"),  # PipeDream without stashing
    "stash": dict(weight_prediction="stash"),  # the backward uses the forward's weights
    "2bw": dict(weight_prediction="2bw"),  # PipeDream-2BW: a step per 4 micro-batches
    "predict": dict(weight_prediction="sgd"),  # SpecTrain: W - s * lr * v
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--modes", nargs="+", choices=list(CONFIGS),
                        default=["sync", "stale", "predict"])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--lr", type=float, default=0.015)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x_train, y_train, x_test, y_test = digits()
    for mode in args.modes:
        config = AsyncPipelineConfig(optimizer="sgd", lr=args.lr, momentum=0.9,
                                     num_microbatches=4, **CONFIGS[mode])
        pipe = AsyncPipeline(build_stage(rank, world, seed=0), config,
                             feature_shapes=feature_shapes(world), loss_fn=F.cross_entropy)
        result = pipe.train(batch_source(x_train, y_train, 32, seed=0), args.steps, 32)
        accuracy = pipe.evaluate(x_test, y_test)
        if rank == 0:
            print(f"{mode:8s} test accuracy {accuracy:.3f}   {args.steps / result.seconds:6.1f} "
                  f"steps/s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
