"""The planner's optimum equals an independent brute force on 200 random instances.

The brute force here shares no code with the planner's enumerators (``plan/space.py``,
``plan/brute_force.py``): it reads the search space as docs/cost-model.md states it, straight
from the model and the cluster, and scores every plan with ``CostModel.estimate``:

- tp divides the GPUs of a node, the heads, the KV heads and the FFN width; pp divides the
  rest and is at most the number of layers; dp = world / (tp pp) divides the batch; on mixed
  clusters each GPU type hosts (its GPUs) / (tp dp) consecutive pipeline ranks, in every order;
- ZeRO stages (dp > 1), sequence parallelism (tp > 1, tp divides the sequence), micro-batch
  sizes dividing the per-rank batch up to the cap; GPipe always, 1F1B and ZB-H1 when m >= pp,
  interleaved with v in 2..max_vpp when m >= pp, pp divides m and there are at least pp v
  blocks;
  ZBV (and DualPipeV when m >= 2 pp) with two chunks per rank in a V when there are at least
  2 pp blocks; no zero-bubble schedule (ZB-H1, ZBV, DualPipeV) with ZeRO-3; FSDP prefetch
  on and off for every ZeRO-3 plan over more than one data-parallel replica, on elsewhere;
- every contiguous split of the layers into pp stages and every per-layer recompute: layers
  with identical figures in one stage are interchangeable (the estimate sums and maxes their
  figures), so per stage each multiset of modes over them is one assignment
  (``test_multisets_of_modes_find_the_per_layer_optimum`` checks this against the plain product);
  V plans split the blocks evenly with one mode for all blocks; interleaved plans take one mode
  for all blocks and, out of every way to put the blocks into the pp v chunks (the embedding in
  the first, the head in the last, interior chunks not empty), the even split where the blocks
  divide, else the even split with the extra blocks in the earliest chunks and every split whose
  interior chunks hold floor or ceil(blocks / chunks) blocks each, the two end chunks any.

Instances: GPT or Llama with 1-10 blocks (3-12 layers), cpu or A100 clusters of 1-8 devices
(one mixed A100 + V100), device memory drawn around the model's footprint so that it binds:
some instances need recompute, ZeRO or pipelining, some fit nothing.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from itertools import combinations, combinations_with_replacement, permutations, product

import pytest

from meshmorph.cost.model import CostModel
from meshmorph.plan.search import PlanDoesNotFit, search
from meshmorph.plan.space import SearchOptions
from meshmorph.schedule.table import Schedule
from meshmorph.spec.cluster import Cluster, parse_cluster
from meshmorph.spec.model import LayerSpec, ModelSpec, Recompute
from meshmorph.spec.plan import Plan, StagePlan
from meshmorph.spec.transformer import TransformerShape, build_transformer

CASES = 200
SEED = 20_251_123
MAX_PLANS = 1_500
"""Plans one instance may ask the brute force to score (larger draws are drawn again)."""


@dataclass(frozen=True)
class Case:
    """One random planning problem and the options both searches get."""

    model: ModelSpec
    cluster: Cluster
    global_batch: int
    options: SearchOptions

    def __str__(self) -> str:
        m, o = self.model, self.options
        memory = ", ".join(f"{g.gpu.name} {g.gpu.memory_gib:.3f} GiB" for g in self.cluster.groups)
        return (f"{m.arch} {m.num_blocks} blocks h{m.hidden_size} a{m.num_heads} "
                f"V{m.vocab_size} s{m.seq_len} on {self.cluster.describe()} ({memory}), "
                f"batch {self.global_batch}, {o.dtype}, zero {o.zero_stages}, "
                f"{', '.join(o.schedules)}, sp {o.sequence_parallel}, mb <= "
                f"{o.max_micro_batch}, vpp <= {o.max_vpp}, recompute {', '.join(o.recompute)}")


# --- the independent enumeration ------------------------------------------------------------
def _layer_key(layer: LayerSpec) -> tuple:
    """Everything the cost model reads of a layer (its name aside)."""
    return (layer.kind, layer.params, layer.tp_split_params, layer.fwd_flops_per_token,
            tuple(sorted(layer.recompute_flops_per_token.items())),
            tuple(sorted(layer.activation.items())), layer.tp_allreduces_fwd, layer.tied_params)


def _modes(layer: LayerSpec, options: SearchOptions) -> tuple[Recompute, ...]:
    return tuple(m for m in options.recompute if m in layer.activation) or (Recompute.NONE,)


def _stage_assignments(model: ModelSpec, start: int, stop: int, options: SearchOptions,
                       per_layer: bool) -> list[tuple[Recompute, ...]]:
    """Every recompute of layers [start, stop): the product over layers, or one assignment per
    multiset of modes over each group of identical layers (``per_layer`` False)."""
    layers = model.layers[start:stop]
    if per_layer:
        return list(product(*(_modes(layer, options) for layer in layers)))
    groups: dict[tuple, list[int]] = {}
    for offset, layer in enumerate(layers):
        groups.setdefault((_layer_key(layer), _modes(layer, options)), []).append(offset)
    choices = [list(combinations_with_replacement(modes, len(members)))
               for (_, modes), members in groups.items()]
    out = []
    for picked in product(*choices):
        modes = [Recompute.NONE] * len(layers)
        for members, multiset in zip(groups.values(), picked, strict=True):
            for offset, mode in zip(members, multiset, strict=True):
                modes[offset] = mode
        out.append(tuple(modes))
    return out


def _rank_gpu_orders(cluster: Cluster, width: int, pp: int) -> list[tuple[str, ...]]:
    """GPU type of each pipeline rank: each type's GPUs / width ranks, types contiguous."""
    ranks: dict[str, int] = {}
    for group in cluster.groups:
        if group.num_gpus % width:
            return []
        ranks[group.gpu.name] = ranks.get(group.gpu.name, 0) + group.num_gpus // width
    if sum(ranks.values()) != pp:
        return []
    return sorted({tuple(n for n in order for _ in range(ranks[n])) for order in permutations(ranks)})


def _shapes(model: ModelSpec, cluster: Cluster, batch: int,
            options: SearchOptions) -> Iterator[tuple[Plan, tuple[str, ...]]]:
    """Every configuration (a Plan without stages) with its GPU type per pipeline rank."""
    world, node = cluster.world_size, min(g.gpus_per_node for g in cluster.groups)
    blocks = model.num_blocks
    for tp in range(1, node + 1):
        if node % tp or model.num_heads % tp or model.num_kv_heads % tp \
                or model.ffn_hidden_size % tp or world % tp:
            continue
        # context parallel: 1, and for long sequences powers of two whose 2 cp chunks split
        # the sequence and that divide the ranks per tp group
        cps = [1] + [c for c in (2, 4, 8, 16) if model.seq_len >= options.cp_min_seq_len
                     and (world // tp) % c == 0 and model.seq_len % (2 * c) == 0
                     and (options.cp_max is None or c <= options.cp_max)]
        for cp, pp in product(cps, range(1, model.num_layers + 1)):
            if (world // tp) % (cp * pp) or batch % (world // (tp * cp * pp)):
                continue
            dp = world // (tp * cp * pp)
            for gpus in _rank_gpu_orders(cluster, tp * cp * dp, pp):
                for b in range(1, min(options.max_micro_batch, batch // dp) + 1):
                    if (batch // dp) % b:
                        continue
                    m = batch // dp // b
                    schedules = [(Schedule.ONE_F_ONE_B, 1)] if pp == 1 else [
                        (s, 1) for s in options.schedules if not s.v_shape
                        and (s == Schedule.GPIPE or (s != Schedule.INTERLEAVED and m >= pp))]
                    if pp > 1 and blocks >= 2 * pp:  # two chunks per rank in a V
                        schedules += [(s, 2) for s in options.schedules if s.v_shape
                                      and (s == Schedule.ZBV or m >= 2 * pp)]
                    if pp > 1 and Schedule.INTERLEAVED in options.schedules and m >= pp \
                            and m % pp == 0:
                        schedules += [(Schedule.INTERLEAVED, v) for v in range(2, options.max_vpp + 1)
                                      if pp * v <= blocks]
                    for zero in options.zero_stages if dp > 1 else (0,):
                        for sp in options.sequence_parallel if tp > 1 else (False,):
                            if sp and (model.seq_len // cp) % tp:
                                continue
                            for schedule, v in schedules:
                                if schedule.split_backward and zero == 3:
                                    continue  # the runtime refuses it (torch loses gradients)
                                # FSDP prefetch: both ways wherever ZeRO-3 gathers over a
                                # data-parallel group; elsewhere it does nothing (left on)
                                for prefetch in (True, False) if zero == 3 and dp * cp > 1 \
                                        else (True,):
                                    yield Plan(model=model.name, seq_len=model.seq_len,
                                               global_batch=batch, tp=tp, pp=pp, dp=dp, cp=cp,
                                               zero=zero, micro_batch=b, num_microbatches=m,
                                               schedule=schedule, vpp=v, sequence_parallel=sp,
                                               dtype=options.dtype, fsdp_prefetch=prefetch), gpus


def _splits(num_layers: int, parts: int) -> Iterator[tuple[tuple[int, int], ...]]:
    for cuts in combinations(range(1, num_layers), parts - 1):
        ends = (0, *cuts, num_layers)
        yield tuple(zip(ends, ends[1:], strict=False))


def _compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every tuple of ``parts`` counts >= 0 summing to ``total``."""
    if parts == 1:
        yield (total,)
        return
    for first in range(total + 1):
        for rest in _compositions(total - first, parts - 1):
            yield (first, *rest)


def interleaved_splits(blocks: int, chunks: int) -> list[tuple[int, ...]]:
    """Block counts per chunk of the documented interleaved space (module docstring), found by
    filtering every way to share the blocks, not by building the allowed ones."""
    if blocks < chunks:  # the space asks for at least pp v blocks
        return []
    low, high = blocks // chunks, -(-blocks // chunks)
    front = tuple(high if i < blocks % chunks else low for i in range(chunks))
    out = []
    for counts in _compositions(blocks, chunks):
        interior = counts[1:-1]
        if any(c == 0 for c in interior):
            continue
        if blocks % chunks == 0:
            keep = all(c == low for c in counts)
        else:
            keep = counts == front or any(all(c == k for c in interior) for k in (low, high))
        if keep:
            out.append(counts)
    return out


def _interleaved_plans(model: ModelSpec, shape: Plan, gpus: tuple[str, ...], mixed: bool,
                       options: SearchOptions) -> Iterator[Plan]:
    for counts in interleaved_splits(model.num_blocks, shape.num_chunks):
        # layer i + 1 is block i; the embedding opens the first chunk, the head closes the last
        ends = [0]
        for c, count in enumerate(counts):
            ends.append(ends[-1] + count + (c == 0) + (c == len(counts) - 1))
        for mode in options.recompute:
            yield replace(shape, stages=tuple(
                StagePlan(start=a, stop=b, recompute=tuple(
                    mode if mode in model.layers[i].activation else Recompute.NONE
                    for i in range(a, b)),
                    gpu=gpus[shape.pp_rank_of_chunk(c)] if mixed else None)
                for c, (a, b) in enumerate(zip(ends, ends[1:], strict=False))))


def every_plan(model: ModelSpec, cluster: Cluster, batch: int, options: SearchOptions,
               per_layer: bool = False) -> Iterator[Plan]:
    """Every complete Plan of the documented search space (module docstring)."""
    mixed = len({g.gpu.name for g in cluster.groups}) > 1
    for shape, gpus in _shapes(model, cluster, batch, options):
        if shape.schedule == Schedule.INTERLEAVED:
            yield from _interleaved_plans(model, shape, gpus, mixed, options)
            continue
        if shape.num_chunks > shape.pp:  # a V: blocks split evenly
            for mode in options.recompute:
                plan = shape.with_even_stages(model, mode)
                if mixed:
                    plan = replace(plan, stages=tuple(
                        replace(s, gpu=gpus[shape.pp_rank_of_chunk(c)])
                        for c, s in enumerate(plan.stages)))
                yield plan
            continue
        for split in _splits(model.num_layers, shape.pp):
            per_stage = [_stage_assignments(model, a, b, options, per_layer) for a, b in split]
            for modes in product(*per_stage):
                yield replace(shape, stages=tuple(
                    StagePlan(start=a, stop=b, recompute=r, gpu=gpus[k] if mixed else None)
                    for k, ((a, b), r) in enumerate(zip(split, modes, strict=True))))


def brute_force_step(case: Case, per_layer: bool = False) -> tuple[float | None, int]:
    """(least step time of a plan that fits or None, plans scored)."""
    cost = CostModel(case.model, case.cluster)
    best, scored = math.inf, 0
    for plan in every_plan(case.model, case.cluster, case.global_batch, case.options, per_layer):
        estimate = cost.estimate(plan)
        scored += 1
        if estimate.fits:
            best = min(best, estimate.step_time_s)
    return (None if best == math.inf else best), scored


def count_plans(case: Case) -> int:
    """Plans brute force would score, without scoring them."""
    total = 0
    for shape, _ in _shapes(case.model, case.cluster, case.global_batch, case.options):
        if shape.schedule == Schedule.INTERLEAVED:
            total += len(case.options.recompute) * len(
                interleaved_splits(case.model.num_blocks, shape.num_chunks))
            continue
        if shape.num_chunks > shape.pp:
            total += len(case.options.recompute)
            continue
        for split in _splits(case.model.num_layers, shape.pp):
            total += math.prod(len(_stage_assignments(case.model, a, b, case.options, False))
                               for a, b in split)
        if total > MAX_PLANS:
            break
    return total


def planner_best(case: Case) -> tuple[Plan, float] | None:
    try:
        result = search(case.model, case.cluster, global_batch=case.global_batch,
                        options=case.options)
    except PlanDoesNotFit:
        return None
    return result.plans[0], result.estimates[0].step_time_s


# --- random instances -------------------------------------------------------------------------
CLUSTERS = ("cpu:1x1", "cpu:1x2", "cpu:1x4", "cpu:2x2", "cpu:1x8", "a100-40g:1x2",
            "a100-40g:1x4", "a100-40g:2x2", "a100-40g:1x8", "a100-40g:1x2+v100-32g:1x2")


def _with_memory(cluster: Cluster, memory_gib: dict[str, float]) -> Cluster:
    groups = tuple(replace(g, gpu=replace(g.gpu, memory_gib=memory_gib[g.gpu.name]))
                   for g in cluster.groups)
    return replace(cluster, groups=groups)


def _footprint_gib(model: ModelSpec, cluster: Cluster, dtype: str) -> float:
    """Memory of one device running the whole model with one sequence, no recompute, beyond
    the fixed reserve: the scale the random memory caps are drawn on."""
    cost = CostModel(model, cluster)
    plan = Plan(model=model.name, seq_len=model.seq_len, global_batch=1,
                dtype=dtype).with_even_stages(model)
    memory = cost.estimate(plan).memory[0]
    return (memory.total - memory.reserved) / 2**30


def random_case(rng: random.Random) -> Case:
    text = rng.choice(CLUSTERS)
    on_cpu = text.startswith("cpu")
    arch = rng.choice(("gpt", "llama"))
    heads = rng.choice((2, 4, 8))
    model = build_transformer(TransformerShape(
        name="tiny", arch=arch, num_layers=rng.randint(1, 10),
        hidden_size=rng.choice((64, 128, 256) if on_cpu else (128, 256, 512)), num_heads=heads,
        vocab_size=rng.choice((512, 8000, 32000)),
        seq_len=rng.choice((512, 2048, 4096) if on_cpu else (2048, 8192))))
    dtype = "fp32" if on_cpu else rng.choice(("bf16", "fp16"))
    base = parse_cluster(text)
    footprint = _footprint_gib(model, base, dtype)
    context = CostModel(model, base).coef.context_bytes / 2**30
    # the fixed reserve plus a share of one device's footprint: from "fits nothing" to "fits
    # everything", most often in between where recompute, ZeRO and pipelining decide
    caps = {g.gpu.name: (context + footprint * rng.uniform(0.05, 1.2)) / 0.95 for g in base.groups}
    recompute = rng.choice(((Recompute.NONE,), (Recompute.NONE, Recompute.FULL),
                            (Recompute.NONE, Recompute.SELECTIVE), tuple(Recompute)))
    options = SearchOptions(
        top_k=1, tolerance=0.0, max_nodes=None, dtype=dtype,
        max_micro_batch=rng.randint(1, 4),
        zero_stages=tuple(sorted(rng.sample((0, 1, 2, 3), rng.randint(1, 2)))),
        schedules=tuple(rng.sample(tuple(Schedule), rng.randint(1, 2))),
        sequence_parallel=rng.choice(((False,), (True,), (False, True))),
        max_vpp=rng.randint(2, 3), recompute=recompute)
    return Case(model, _with_memory(base, caps), rng.choice((2, 4, 6, 8, 12, 16)), options)


def _cases() -> list[Case]:
    rng = random.Random(SEED)
    cases: list[Case] = []
    while len(cases) < CASES:
        case = random_case(rng)
        if count_plans(case) <= MAX_PLANS:
            cases.append(case)
    return cases


@pytest.mark.timeout(240)
def test_exact_planner_equals_an_independent_brute_force_on_200_random_instances() -> None:
    started = time.perf_counter()
    cases = _cases()
    fits = infeasible = recomputed = pipelined = deep = scored = uneven = 0
    for index, case in enumerate(cases):
        brute, count = brute_force_step(case)
        found = planner_best(case)
        scored += count
        assert (found is None) == (brute is None), (
            f"case {index}: planner {found} vs brute force {brute} disagree on whether "
            f"anything fits: {case}")
        if brute is None or found is None:
            infeasible += 1
            continue
        plan, step = found
        assert step == pytest.approx(brute, rel=1e-9), f"case {index}: {case}"
        fits += 1
        deep += case.model.num_layers >= 10
        recomputed += any(m != Recompute.NONE for m in plan.recompute_of_layer())
        pipelined += plan.pp > 1
        uneven += plan.schedule == Schedule.INTERLEAVED and len({
            s.stop - s.start - (c == 0) - (c == len(plan.stages) - 1)
            for c, s in enumerate(plan.stages)}) > 1
    elapsed = time.perf_counter() - started
    print(f"{len(cases)} cases: {fits} fit ({recomputed} recompute, {pipelined} pipelined, "
          f"{deep} with 10-12 layers, {uneven} interleaved with uneven chunks), {infeasible} "
          f"fit nothing; {scored} plans scored in "
          f"{elapsed:.1f} s")
    # the draw really covers what the claim is about
    assert fits >= 95 and infeasible >= 10, (fits, infeasible)
    assert recomputed >= 10 and pipelined >= 10 and deep >= 10, (recomputed, pipelined, deep)


@pytest.mark.timeout(120)
def test_multisets_of_modes_find_the_per_layer_optimum() -> None:
    """The brute force's one shortcut: scoring one recompute per multiset of modes over the
    identical layers of a stage finds the same optimum as scoring every per-layer product."""
    rng = random.Random(SEED + 1)
    compared = shortcut = 0
    while compared < 20:
        case = random_case(rng)
        if case.model.num_layers > 6 or count_plans(case) > 300:
            continue
        every, every_count = brute_force_step(case, per_layer=True)
        if every_count > 3_000:
            continue
        multisets, multiset_count = brute_force_step(case)
        assert (every is None) == (multisets is None), case
        if every is not None:
            assert multisets == pytest.approx(every, rel=1e-12), case
        shortcut += multiset_count < every_count
        compared += 1
    assert shortcut >= 4  # the shortcut really left plans out in these cases


def test_the_interleaved_splits_are_the_planners_space() -> None:
    from meshmorph.plan.partition_search import interleaved_block_counts

    for blocks in range(1, 13):  # every composition is enumerated: keep the range small
        for chunks in range(2, 9):
            ours = interleaved_splits(blocks, chunks)
            assert sorted(ours) == sorted(interleaved_block_counts(blocks, chunks)), (blocks, chunks)
            assert all(sum(c) == blocks for c in ours)
            if blocks < chunks:
                assert ours == []
            elif blocks % chunks == 0:
                assert ours == [(blocks // chunks,) * chunks]
    # 7 blocks over pp 2 x vpp 2: Megatron's earlier-chunks-first split, then every split with
    # interior chunks of 1 block (the ends share 5) or of 2 blocks (the ends share 3)
    assert sorted(interleaved_splits(7, 4)) == sorted([
        (2, 2, 2, 1),
        (0, 1, 1, 5), (1, 1, 1, 4), (2, 1, 1, 3), (3, 1, 1, 2), (4, 1, 1, 1), (5, 1, 1, 0),
        (0, 2, 2, 3), (1, 2, 2, 2), (3, 2, 2, 0)])


@pytest.mark.timeout(240)
def test_exact_planner_equals_the_brute_force_on_interleaved_instances() -> None:
    """Interleaved alone, on the random instances: blocks that rarely split evenly over
    pp x vpp chunks, so the uneven splits decide."""
    rng = random.Random(SEED + 1)
    compared = uneven = 0
    while compared < 60:
        case = random_case(rng)
        case = replace(case, options=replace(case.options, schedules=(Schedule.INTERLEAVED,)))
        if count_plans(case) > MAX_PLANS:
            continue
        brute, _ = brute_force_step(case)
        found = planner_best(case)
        assert (found is None) == (brute is None), case
        compared += 1
        if brute is None or found is None:
            continue
        plan, step = found
        assert step == pytest.approx(brute, rel=1e-9), case
        counts = {s.stop - s.start - (c == 0) - (c == len(plan.stages) - 1)
                  for c, s in enumerate(plan.stages)}
        uneven += plan.schedule == Schedule.INTERLEAVED and len(counts) > 1
    assert uneven >= 3, uneven  # the uneven splits really were chosen
