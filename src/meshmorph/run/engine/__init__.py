"""The engine: one optimizer step of any Plan (micro-batches, pipelines, gradient reduction,
norm and clipping, loss scaling) and what its first step holds and sends (the state line)."""
