"""What to rent: every (GPU type, node count, spot or on-demand) of the cloud catalog's 8-GPU
instance types, planned and simulated; the Pareto front of (time, cost) and one recommendation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshmorph.predict.cloud_catalog import CloudCatalog
from meshmorph.predict.overheads import Overheads
from meshmorph.predict.simulate import SimulationConfig, simulate_run, summarize
from meshmorph.predict.training_job import TrainingJob, default_global_batch, steps_for_tokens
from meshmorph.spec.cluster import Cluster, NodeGroup
from meshmorph.spec.gpus import gpu, link
from meshmorph.spec.model import ModelSpec


@dataclass(slots=True, kw_only=True)
class AdviceOptions:
    """Limits of the search (kept small so a 7B model is advised in seconds)."""

    node_counts: tuple[int, ...] = (1, 2, 4, 8)
    """Instances tried per instance type."""
    runs: int = 5
    """Simulated runs per option (P50/P90 over them)."""
    min_gpus_per_instance: int = 8
    """Only instance types with at least this many GPUs (multi-node training)."""
    deadline_h: float | None = None
    """Drop options whose P90 time exceeds this."""
    budget_usd: float | None = None
    """Drop options whose P90 cost exceeds this."""
    max_days: float = 90.0
    """Skip options whose revocation-free time is longer than this (not worth simulating)."""


def _cluster(instance: Any, nodes: int) -> Cluster:
    group = NodeGroup(gpu=gpu(instance.gpu), num_nodes=nodes, gpus_per_node=instance.gpus,
                      intra_link=link(instance.interconnect))
    return Cluster(groups=(group,), inter_link=link(instance.network), name=instance.name,
                   provider=instance.provider)


def advise(model: ModelSpec, tokens: float, catalog: CloudCatalog,
           options: AdviceOptions) -> list[dict[str, Any]]:
    """Every option that fits, with its plan and simulated P50/P90 time and cost."""
    out = []
    for instance in catalog.instances.values():
        if instance.gpus < options.min_gpus_per_instance:
            continue
        for nodes in options.node_counts:
            cluster = _cluster(instance, nodes)
            batch = default_global_batch(model.seq_len, cluster.world_size)
            steps = steps_for_tokens(tokens, batch, model.seq_len)
            for spot in (False, True):
                price = instance.price_per_gpu_hour(spot)
                if price is None:
                    continue
                job = TrainingJob(model=model, cluster=cluster, global_batch=batch,
                                  total_steps=steps, price_per_gpu_hour=price)
                plan = job.plan(nodes)  # cached per job; shared below through _plans
                if plan is None or steps * job.step_time_s(nodes) > options.max_days * 86400:
                    break
                provider = catalog.provider(instance.provider if spot else "on-demand")
                hazard = provider.hazard_for(instance.gpu)
                overheads = Overheads(spot=spot, gpu=instance.gpu, gpus_per_node=instance.gpus,
                                      inter_node_gbps=link(instance.network).bandwidth_gbps)
                strategies = ("restart", "reshape") if spot else ("on-demand",)
                best = None
                for strategy in strategies:
                    config = SimulationConfig(strategy=strategy)
                    runs = [simulate_run(job, hazard, overheads, config, seed)
                            for seed in range(options.runs)]
                    summary = summarize(runs)
                    if best is None or summary["cost_usd_p50"] < best[1]["cost_usd_p50"]:
                        best = (strategy, summary)
                strategy, summary = best
                out.append({"instance": instance.name, "gpu": instance.gpu,
                            "gpus": cluster.world_size, "nodes": nodes, "spot": spot,
                            "strategy": strategy, "price_per_gpu_hour": price,
                            "price_date": instance.date,
                            "time_h": summary["time_h_p50"], "time_h_p90": summary["time_h_p90"],
                            "cost_usd": summary["cost_usd_p50"],
                            "cost_usd_p90": summary["cost_usd_p90"],
                            "plan": {k: v for k, v in plan.to_dict().items() if k != "stages"}})
    return [o for o in out
            if (options.deadline_h is None or o["time_h_p90"] <= options.deadline_h)
            and (options.budget_usd is None or o["cost_usd_p90"] <= options.budget_usd)]


def pareto(options: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Options no other option beats on both P50 time and P50 cost, fastest first."""
    front = []
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
