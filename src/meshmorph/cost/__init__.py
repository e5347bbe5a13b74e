"""The cost model: compute, communication, memory and pipeline simulation. Imports no torch."""

from meshmorph.cost.coefficients import CostCoefficients
from meshmorph.cost.estimate import Estimate, StageMemory
from meshmorph.cost.model import CostModel
from meshmorph.cost.profile import Profile

__all__ = ["CostCoefficients", "CostModel", "Estimate", "Profile", "StageMemory"]
