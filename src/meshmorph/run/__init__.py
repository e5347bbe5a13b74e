"""Runs a Plan on torch.distributed: models, parallelism, pipeline, data, checkpoints, launch."""
