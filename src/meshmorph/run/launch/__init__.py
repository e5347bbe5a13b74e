"""The launcher process: check a job completely, start torchrun, supervise it, own the run folder."""
