"""The runtime's rule for context parallelism: meshmorph prices and plans cp > 1, it does not run it.

torch's ``context_parallel`` (torch.distributed.tensor.experimental) rotates K/V through
``scaled_dot_product_attention``'s flash and memory-efficient CUDA kernels; meshmorph's runtime
trains on CPU processes over gloo as well, and its models, meshes and checkpoints have no
sequence dimension split yet. So ``meshmorph run`` and the elastic layouts refuse a plan with
cp > 1 before anything starts, and the planners the runtime calls search cp 1 only.
"""

from __future__ import annotations

from meshmorph.spec.plan import Plan, PlanError


def refuse_context_parallel(plan: Plan, where: str = "meshmorph run") -> None:
    """A PlanError naming the constraint and a way out when ``plan`` has cp > 1."""
    if plan.cp > 1:
        raise PlanError(
            f"{where} does not run context parallelism: the plan has cp {plan.cp} (ring "
            f"attention needs torch's context_parallel, which runs on CUDA SDPA kernels, and "
            f"meshmorph's runtime does not split sequences); re-plan with cp 1 (meshmorph plan "
            f"--max-cp 1) or fold the {plan.cp} ranks into dp or tp, at a shorter sequence if "
            f"it no longer fits"
        )
