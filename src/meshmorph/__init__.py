"""meshmorph: plan, run and reshape hybrid-parallel training of PyTorch models."""

__version__ = "0.1.0"
