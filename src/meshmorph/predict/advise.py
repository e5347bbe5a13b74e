"""What to rent: every instance type of the cloud catalog with at least a few GPUs, at 1-8
instances, under each policy (its zones from the packaged data), planned and simulated; the Pareto
front of (P50 time, P50 cost) within a deadline and a budget (P90), and one recommendation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshmorph.predict.cloud_catalog import CloudCatalog, InstanceType
from meshmorph.predict.market import Market, MarketRequest, build_market
from meshmorph.predict.overheads import Overheads
from meshmorph.predict.policy import Policy
from meshmorph.predict.scenario import Scenario, run_scenario
from meshmorph.predict.training_job import TrainingJob, default_global_batch, steps_for_tokens
from meshmorph.spec.cluster import Cluster, NodeGroup
from meshmorph.spec.gpus import gpu, link
from meshmorph.spec.model import ModelSpec


@dataclass(slots=True, kw_only=True)
class AdviceOptions:
    """Limits of the search (kept small so a 7B model is advised in tens of seconds)."""

    node_counts: tuple[int, ...] = (1, 2, 4, 8)
    """Instances tried per instance type."""
    runs: int = 5
    """Simulated runs per option (P50/P90 over them)."""
    min_gpus_per_instance: int = 4
    """Only instance types with at least this many GPUs (multi-GPU nodes)."""
    deadline_h: float | None = None
    """Drop options whose P90 time exceeds this; adds the deadline policy."""
    budget_usd: float | None = None
    """Drop options whose P90 cost exceeds this."""
    max_days: float = 90.0
    """Skip options whose preemption-free time is longer than this (not worth simulating)."""

    @property
    def policies(self) -> tuple[Policy, ...]:
        """Restart, multi-zone, deadline (with a deadline) and on-demand. Reshape is left to
        ``simulate --policy reshape``: each change of node count is planned by Reshape's move
        planner, 2-60 s each for the models tried, too slow for a grid."""
        spot = (Policy.RESTART, Policy.MULTI_ZONE)
        return spot + ((Policy.DEADLINE,) if self.deadline_h is not None else ()) + \
            (Policy.ON_DEMAND,)


def _cluster(instance: InstanceType, nodes: int) -> Cluster:
    group = NodeGroup(gpu=gpu(instance.gpu), num_nodes=nodes, gpus_per_node=instance.gpus,
                      intra_link=link(instance.interconnect))
    return Cluster(groups=(group,), inter_link=link(instance.network), name=instance.name,
                   provider=instance.provider)


def _options(instance: InstanceType, job: TrainingJob, market: Market,
             options: AdviceOptions) -> list[dict[str, Any]]:
    """Every policy on ``job`` as an option row."""
    plan = job.plan(job.nodes)
    assert plan is not None
    results = run_scenario(Scenario(job=job, market=market, overheads=Overheads(),
                                    policies=options.policies, runs=options.runs,
                                    deadline_h=options.deadline_h))
    out = []
    for r in results:
        s = r.model
        out.append({"instance": instance.name, "gpu": instance.gpu, "nodes": job.nodes,
                    "gpus": job.cluster.world_size, "policy": str(r.policy),
                    "spot": r.policy is not Policy.ON_DEMAND, "zones": s["zones"],
                    "time_h": s["time_h_p50"], "time_h_p90": s["time_h_p90"],
                    "cost_usd": s["cost_usd_p50"], "cost_usd_p90": s["cost_usd_p90"],
                    "met_deadline": s.get("met_deadline"), "price_date": instance.date,
                    "notes": list(market.notes),
                    "plan": {k: v for k, v in plan.to_dict().items() if k != "stages"}})
    return out


def advise(model: ModelSpec, tokens: float, catalog: CloudCatalog,
           options: AdviceOptions) -> list[dict[str, Any]]:
    """Every option that fits, with its plan, policy, zones and simulated P50/P90 time and cost."""
    out = []
    for instance in catalog.instances.values():
        if instance.gpus < options.min_gpus_per_instance or None in (
                instance.spot_usd_per_h, instance.on_demand_usd_per_h):
            continue
        market = build_market(MarketRequest(gpu=instance.gpu, gpus_per_node=instance.gpus,
                                            provider=instance.provider), catalog)
        for nodes in options.node_counts:
            cluster = _cluster(instance, nodes)
            batch = default_global_batch(model.seq_len, cluster.world_size)
            job = TrainingJob(model=model, cluster=cluster, global_batch=batch,
                              total_steps=steps_for_tokens(tokens, batch, model.seq_len))
            step = job.step_time_s(nodes)
            if step is None or job.total_steps * step > options.max_days * 86400:
                continue
            out += _options(instance, job, market, options)
    return [o for o in out
            if (options.deadline_h is None or o["time_h_p90"] <= options.deadline_h)
            and (options.budget_usd is None or o["cost_usd_p90"] <= options.budget_usd)]


def pareto(options: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Options no other option beats on both P50 time and P50 cost, fastest first."""
    front: list[dict[str, Any]] = []
    for option in sorted(options, key=lambda o: (o["time_h"], o["cost_usd"])):
        if not front or option["cost_usd"] < front[-1]["cost_usd"]:
            front.append(option)
    return front


def recommend(front: list[dict[str, Any]], deadline_h: float | None) -> dict[str, Any] | None:
    """The cheapest option of the front within the deadline; without one, the option that buys
    the most time per dollar spent above the cheapest (the knee)."""
    if not front:
        return None
    if deadline_h is not None:
        return min(front, key=lambda o: o["cost_usd"])
    cheapest = front[-1]
    best, best_ratio = cheapest, 0.0
    for option in front[:-1]:
        saved_h = cheapest["time_h"] - option["time_h"]
        extra = option["cost_usd"] - cheapest["cost_usd"]
        ratio = saved_h / extra if extra > 0 else float("inf")
        if ratio > best_ratio and extra <= 0.25 * cheapest["cost_usd"]:
            best, best_ratio = option, ratio
    return best
