"""The planner (branch and bound) finds exactly the plan brute-force enumeration finds.

Tiny random instances: a 2-4 block GPT or Llama, small enough for brute force, on 1-8 GPUs
(CPU stand-ins with 4 GiB, A100-40GB with long sequences, and a mixed A100 + V100 cluster), so
that memory binds in some of them and forces recompute, ZeRO or pipelining.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from meshmorph.plan.brute_force import brute_force, count_plans
from meshmorph.plan.search import PlanDoesNotFit, search
from meshmorph.plan.space import SearchOptions, configurations
from meshmorph.schedule.table import Schedule
from meshmorph.spec.cluster import Cluster, parse_cluster
from meshmorph.spec.model import ModelSpec, Recompute
from meshmorph.spec.transformer import TransformerShape, build_transformer

MAX_PLANS = 5_000  # about one second of brute force per instance

CPU_CLUSTERS = ("cpu:1x1", "cpu:1x2", "cpu:1x4", "cpu:2x2")
GPU_CLUSTERS = ("a100-40g:1x4", "a100-40g:1x8", "a100-40g:2x2", "a100-40g:1x2+v100-32g:1x2")
MIXED = "a100-40g:1x2+v100-32g:1x2"


@dataclass(frozen=True)
class Instance:
    """One tiny planning problem."""

    arch: str
    blocks: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    cluster: str
    global_batch: int
    zero_stages: tuple[int, ...]
    schedules: tuple[Schedule, ...]
    sequence_parallel: tuple[bool, ...]
    max_micro_batch: int
    max_vpp: int = 2
    tp_degrees: tuple[int, ...] | None = None
    pp_degrees: tuple[int, ...] | None = None
    megatron_2021: bool = False
    """Attention that keeps its s x s scores, and dropout (as Megatron-LM 2021 ran); False: as
    meshmorph's runtime runs (flash attention, no dropout)."""
    compile: bool = True
    """``Plan.compile`` of every plan (the fixed cases were chosen under compiled prices; the
    drawn ones try both)."""

    def model(self) -> ModelSpec:
        return build_transformer(TransformerShape(
            name="tiny", arch=self.arch, num_layers=self.blocks, hidden_size=self.hidden,
            num_heads=self.heads, vocab_size=self.vocab, seq_len=self.seq_len,
            flash_attention=not self.megatron_2021, dropout=self.megatron_2021,
            runtime=not self.megatron_2021))

    def spec(self) -> Cluster:
        return parse_cluster(self.cluster)

    def options(self, tolerance: float = 0.0) -> SearchOptions:
        return SearchOptions(
            top_k=1, tolerance=tolerance, max_micro_batch=self.max_micro_batch,
            zero_stages=self.zero_stages, schedules=self.schedules,
            sequence_parallel=self.sequence_parallel, max_vpp=self.max_vpp,
            tp_degrees=self.tp_degrees, pp_degrees=self.pp_degrees,
            dtype="fp32" if self.cluster.startswith("cpu") else "bf16", compile=self.compile)

    def plans_to_score(self) -> int:
        model, options = self.model(), self.options()
        configs = list(configurations(model, self.spec(), self.global_batch, options))
        return count_plans(model, configs, options)


@st.composite
def instances(draw: st.DrawFn) -> Instance:
    cluster = draw(st.sampled_from(CPU_CLUSTERS + GPU_CLUSTERS))
    on_cpu = cluster.startswith("cpu")
    return Instance(
        arch=draw(st.sampled_from(("gpt", "llama"))),
        blocks=draw(st.integers(2, 4)),
        hidden=draw(st.sampled_from((64, 128, 256) if on_cpu else (128, 256, 512))),
        heads=draw(st.sampled_from((2, 4, 8))),
        seq_len=draw(st.sampled_from((512, 2048, 4096) if on_cpu else (2048, 8192))),
        vocab=draw(st.sampled_from((512, 8000, 32000))),
        cluster=cluster,
        global_batch=draw(st.integers(4, 16)),
        zero_stages=tuple(sorted(draw(st.lists(st.sampled_from((0, 1, 2, 3)), min_size=1,
                                               max_size=2, unique=True)))),
        schedules=tuple(draw(st.lists(st.sampled_from(tuple(Schedule)), min_size=1, max_size=2,
                                      unique=True))),
        sequence_parallel=draw(st.sampled_from(((False,), (True,), (False, True)))),
        max_micro_batch=draw(st.integers(1, 3)),
        max_vpp=draw(st.integers(2, 3)),
        compile=draw(st.booleans()),
        pp_degrees=draw(st.sampled_from((None, (2,), (4,)))),
    )


def _planner_step(instance: Instance, tolerance: float) -> float | None:
    try:
        result = search(instance.model(), instance.spec(), global_batch=instance.global_batch,
                        options=instance.options(tolerance))
    except PlanDoesNotFit:
        return None
    return result.estimates[0].step_time_s


def _brute_step(instance: Instance) -> float | None:
    try:
        _, estimate = brute_force(instance.model(), instance.spec(),
                                  global_batch=instance.global_batch, options=instance.options())
    except PlanDoesNotFit:
        return None
    return estimate.step_time_s


# Fixed cases that cover every schedule, every ZeRO stage, sequence parallelism, recompute forced
# by memory, the mixed cluster and "nothing fits"; hypothesis adds random ones.
GPIPE_CPU_NEEDS_RECOMPUTE = Instance(
    arch="gpt", blocks=3, hidden=256, heads=4, seq_len=4096, vocab=8000, cluster="cpu:1x4",
    global_batch=8, zero_stages=(0,), schedules=(Schedule.GPIPE,), sequence_parallel=(False,),
    max_micro_batch=1, pp_degrees=(2,), megatron_2021=True)
ONE_F_ONE_B_SP = Instance(
    arch="llama", blocks=3, hidden=512, heads=8, seq_len=8192, vocab=32000, cluster="a100-40g:1x8",
    global_batch=8, zero_stages=(1,), schedules=(Schedule.ONE_F_ONE_B,), sequence_parallel=(True,),
    max_micro_batch=2, tp_degrees=(2,), pp_degrees=(2,))
INTERLEAVED_MIXED = Instance(
    arch="gpt", blocks=4, hidden=256, heads=4, seq_len=8192, vocab=8000, cluster=MIXED,
    global_batch=8, zero_stages=(2,), schedules=(Schedule.INTERLEAVED,), sequence_parallel=(False,),
    max_micro_batch=2)
ZERO_BUBBLE_ZERO2_MIXED = Instance(  # a 32000 vocabulary's loss makes tp 2 x dp 1 the best
    arch="llama", blocks=3, hidden=512, heads=8, seq_len=8192, vocab=8000, cluster=MIXED,
    global_batch=8, zero_stages=(2,), schedules=(Schedule.ZERO_BUBBLE,),
    sequence_parallel=(False, True), max_micro_batch=2)
ASYNC_PP2 = Instance(
    arch="gpt", blocks=4, hidden=256, heads=4, seq_len=4096, vocab=8000, cluster="a100-40g:1x4",
    global_batch=8, zero_stages=(0, 1), schedules=(Schedule.ASYNC,), sequence_parallel=(False,),
    max_micro_batch=2, pp_degrees=(2,))
ZBV_MIXED = Instance(
    arch="gpt", blocks=4, hidden=256, heads=4, seq_len=8192, vocab=8000, cluster=MIXED,
    global_batch=8, zero_stages=(0, 2), schedules=(Schedule.ZBV,), sequence_parallel=(False,),
    max_micro_batch=2, pp_degrees=(2,))
DUALPIPEV_PP2 = Instance(
    arch="llama", blocks=4, hidden=256, heads=4, seq_len=4096, vocab=8000, cluster="a100-40g:1x4",
    global_batch=16, zero_stages=(0, 1), schedules=(Schedule.DUALPIPEV,),
    sequence_parallel=(False,), max_micro_batch=2, pp_degrees=(2,))
NOTHING_FITS = Instance(
    arch="gpt", blocks=2, hidden=256, heads=8, seq_len=8192, vocab=32000, cluster="cpu:1x1",
    global_batch=16, zero_stages=(0,), schedules=(Schedule.GPIPE,), sequence_parallel=(False,),
    max_micro_batch=2)
FIXED = (GPIPE_CPU_NEEDS_RECOMPUTE, ONE_F_ONE_B_SP, INTERLEAVED_MIXED, ZERO_BUBBLE_ZERO2_MIXED,
         ASYNC_PP2, ZBV_MIXED, DUALPIPEV_PP2, NOTHING_FITS)


def _with_examples(test):  # type: ignore[no-untyped-def]
    for fixed in FIXED:
        test = example(instance=fixed)(test)
    return test


@pytest.mark.timeout(120)
@settings(max_examples=25, deadline=None, derandomize=True)
@_with_examples
@given(instance=instances())
def test_exact_planner_step_equals_brute_force_optimum(instance: Instance) -> None:
    assume(instance.plans_to_score() <= MAX_PLANS)
    brute = _brute_step(instance)
    planner = _planner_step(instance, tolerance=0.0)
    assert (planner is None) == (brute is None), (
        f"planner {planner} vs brute force {brute}: they disagree on whether anything fits "
        f"for {instance}")
    if brute is not None:
        assert planner == pytest.approx(brute, rel=1e-9), instance


@pytest.mark.timeout(60)
@pytest.mark.parametrize("instance", FIXED[:-1],
                         ids=["gpipe", "1f1b-sp", "interleaved", "zb-zero3", "async", "zbv",
                              "dualpipev"])
def test_default_tolerance_planner_is_within_0_1_percent_of_brute_force(instance: Instance) -> None:
    brute = _brute_step(instance)
    planner = _planner_step(instance, tolerance=1e-3)
    assert brute is not None and planner is not None
    assert brute * (1 - 1e-9) <= planner <= brute * (1 + 1e-3), (planner, brute)


def test_fixed_cases_cover_recompute_sp_every_schedule_and_zero_stage() -> None:
    """The fixed cases really exercise what they claim (so the property test cannot go soft)."""
    chosen = {}
    for instance in FIXED[:-1]:
        plan, _ = brute_force(instance.model(), instance.spec(), global_batch=instance.global_batch,
                              options=instance.options())
        chosen[instance] = plan
    assert {p.schedule for p in chosen.values()} == set(Schedule)
    assert chosen[GPIPE_CPU_NEEDS_RECOMPUTE].pp > 1
    assert chosen[ASYNC_PP2].pp == 2
    assert any(mode != Recompute.NONE
               for mode in chosen[GPIPE_CPU_NEEDS_RECOMPUTE].recompute_of_layer())
    assert chosen[ONE_F_ONE_B_SP].sequence_parallel and chosen[ONE_F_ONE_B_SP].zero == 1
    assert chosen[INTERLEAVED_MIXED].vpp == 2 and chosen[INTERLEAVED_MIXED].zero == 2
    assert {s.gpu for s in chosen[ZERO_BUBBLE_ZERO2_MIXED].stages} == {"a100-40g", "v100-32g"}
    assert chosen[ZERO_BUBBLE_ZERO2_MIXED].zero == 2
    for v_shaped in (ZBV_MIXED, DUALPIPEV_PP2):  # two chunks per rank, placed in a V
        assert chosen[v_shaped].vpp == 2 and chosen[v_shaped].chunks_of(0) == [0, 3]
    assert {s.gpu for s in chosen[ZBV_MIXED].stages} == {"a100-40g", "v100-32g"}
    with pytest.raises(PlanDoesNotFit):
        brute_force(NOTHING_FITS.model(), NOTHING_FITS.spec(),
                    global_batch=NOTHING_FITS.global_batch, options=NOTHING_FITS.options())


def test_brute_force_refuses_instances_too_large_to_enumerate() -> None:
    model = build_transformer(TransformerShape(name="big", arch="gpt", num_layers=12,
                                               hidden_size=256, num_heads=4, vocab_size=512,
                                               seq_len=512))
    with pytest.raises(ValueError, match="restrict the options"):
        brute_force(model, parse_cluster("cpu:1x4"), global_batch=8, max_plans=1000)


def test_brute_force_scores_every_partition_and_recompute_assignment() -> None:
    # 2 blocks -> 4 layers; pp 1 on one GPU: 1 partition x 3^2 block modes (embedding/head: none)
    instance = Instance(arch="gpt", blocks=2, hidden=64, heads=2, seq_len=512, vocab=512,
                        cluster="cpu:1x1", global_batch=4, zero_stages=(0,),
                        schedules=(Schedule.ONE_F_ONE_B,), sequence_parallel=(False,),
                        max_micro_batch=1)
    assert instance.plans_to_score() == 9
    # 2 GPUs, pp 2: C(3, 1) = 3 partitions x 9, for each schedule that fits m = 4 >= pp
    two = Instance(**{**instance.__dict__, "cluster": "cpu:1x2", "schedules": (Schedule.GPIPE,)})
    model, options = two.model(), two.options()
    configs = list(configurations(model, two.spec(), two.global_batch, options))
    pp2 = [c for c in configs if c.plan.pp == 2]
    assert len(pp2) == 1 and count_plans(model, pp2, options) == math.comb(3, 1) * 9


def test_zero_bubble_planner_finds_the_brute_force_partition_on_two_ranks() -> None:
    # ZB-H1 runs weight-gradient ops while the input-gradient chain goes upstream, so a bound that
    # adds the upstream backward after the last rank's whole work would cut the optimum here
    instance = Instance(arch="gpt", blocks=4, hidden=512, heads=8, seq_len=2048, vocab=32000,
                        cluster="cpu:1x2", global_batch=4, zero_stages=(0,),
                        schedules=(Schedule.ZERO_BUBBLE,), sequence_parallel=(False,),
                        max_micro_batch=1, tp_degrees=(1,), pp_degrees=(2,), megatron_2021=True)
    brute = _brute_step(instance)
    # (36.643 s before the tied embedding's gradient all-reduce across the two ranks was priced,
    # 36.679 s before the loss was priced by the bytes its kernels move)
    assert brute == pytest.approx(36.88875908657778, rel=1e-9)
    assert _planner_step(instance, tolerance=0.0) == pytest.approx(brute, rel=1e-9)
