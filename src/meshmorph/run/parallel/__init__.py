"""Parallelism applied to a model chunk: the one mesh owner, tensor/sequence parallel, recompute,
compile and data parallel (DDP, FSDP2, ZeRO-1's sharded optimizer), in a fixed order."""
