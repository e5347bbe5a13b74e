"""The equivalence matrix: every layout the runtime trains on 4 processes, and the one spawned
part that trains them all (``MATRIX_PART``, in the ``world4`` world).

For each layout every rank builds its engine, compares its live shards with ``Layout`` before
the first step and after it (``LiveLayoutCheck``: tests/dist/test_layout_live.py reads that),
trains ``STEPS`` steps and reports losses, gradient norms and the final parameters
(``harness.train_and_report``: tests/dist/test_equivalence.py holds them to the one-device
oracle). One engine per layout serves both checks: the layout check's first step is the
matrix's first step (the same weights and batch).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from meshmorph.plan.partition_search import stages_of_counts
from meshmorph.schedule.table import Schedule
from meshmorph.spec.model import ModelSpec, Recompute
from meshmorph.spec.plan import Plan, StagePlan
from meshmorph.spec.transformer import TransformerShape, build_transformer
from tests.helpers.harness import each_case, train_and_report
from tests.helpers.oracle import OPTIM, SEED, SEQ, even_plan, gpt_tiny, token_batches
from tests.helpers.world import Part

WORLD = 4
STEPS = 3


@dataclass(frozen=True, slots=True)
class Layout:
    """One entry of the equivalence matrix."""

    name: str
    """Test id."""
    model: ModelSpec
    """Model the layout trains."""
    plan: Plan
    """The parallel layout (world size 4)."""


def _llama() -> ModelSpec:
    from meshmorph.spec.catalog import catalog_model

    return catalog_model("llama-tiny", seq_len=SEQ)


def _gpt(name: str, num_layers: int, vocab_size: int = 128) -> ModelSpec:
    return build_transformer(TransformerShape(name=name, arch="gpt", num_layers=num_layers,
                                              hidden_size=32, num_heads=4, vocab_size=vocab_size,
                                              seq_len=SEQ))


def _recompute_stages() -> tuple[StagePlan, ...]:
    n, f, s = Recompute.NONE, Recompute.FULL, Recompute.SELECTIVE
    return (StagePlan(start=0, stop=3, recompute=(n, f, s)),
            StagePlan(start=3, stop=6, recompute=(s, f, n)))


def layouts() -> list[Layout]:
    gpt, llama = gpt_tiny(), _llama()
    deep = _gpt("gpt-deep", 8)  # 8 blocks: one per chunk of pp 4 x vpp 2
    five = _gpt("gpt-five", 5)  # 5 blocks: no even split over the 4 chunks of pp 2 x vpp 2
    odd_vocab = _gpt("gpt-odd-vocab", 2, 251)  # tp 2 does not divide: embedding/head replicated
    plan = even_plan
    return [
        Layout("dp4", gpt, plan(gpt, dp=4, global_batch=8, num_microbatches=2)),
        Layout("zero3_dp4", gpt, plan(gpt, dp=4, zero=3, global_batch=8, num_microbatches=2)),
        Layout("zero1_dp4", gpt, plan(gpt, dp=4, zero=1, global_batch=8, num_microbatches=2)),
        Layout("zero2_dp4", gpt, plan(gpt, dp=4, zero=2, global_batch=8, num_microbatches=2)),
        Layout("tp2_dp2_sp_zero2", gpt, plan(gpt, tp=2, dp=2, zero=2, sequence_parallel=True,
                                             global_batch=8, num_microbatches=2, micro_batch=2)),
        Layout("tp2_dp2_replicate", llama, plan(llama, tp=2, dp=2, global_batch=4,
                                                num_microbatches=2)),
        Layout("pp2_dp2_1f1b", gpt, plan(gpt, pp=2, dp=2, global_batch=8, num_microbatches=4)),
        Layout("pp2_dp2_zero2", gpt, plan(gpt, pp=2, dp=2, zero=2, global_batch=8,
                                          num_microbatches=4)),
        Layout("pp2_dp2_zero3", llama, plan(llama, pp=2, dp=2, zero=3, global_batch=8,
                                            num_microbatches=4)),
        Layout("pp2_tp2", gpt, plan(gpt, pp=2, tp=2, global_batch=4, num_microbatches=2,
                                    micro_batch=2)),
        Layout("pp4_interleaved_vpp2", deep,
               plan(deep, pp=4, vpp=2, schedule=Schedule.INTERLEAVED, global_batch=4,
                    num_microbatches=4)),
        # uneven interleaved chunks as the planner may choose them (plan.partition_search):
        # 3, 1, 1 and 0 blocks, the last chunk the head alone, tied to rank 0's embedding
        Layout("pp2_dp2_interleaved_uneven_5_blocks", five,
               replace(plan(five, pp=2, dp=2, vpp=2, schedule=Schedule.INTERLEAVED,
                            global_batch=8, num_microbatches=4),
                       stages=stages_of_counts(five, (3, 1, 1, 0), Recompute.NONE))),
        Layout("pp2_zero3_dp2_recompute", gpt,
               replace(plan(gpt, pp=2, dp=2, zero=3, global_batch=4, num_microbatches=2),
                       stages=_recompute_stages())),
        Layout("gpipe_pp2_dp2", llama, plan(llama, pp=2, dp=2, schedule=Schedule.GPIPE,
                                            global_batch=6, num_microbatches=3)),
        Layout("zb_pp2_dp2", gpt, plan(gpt, pp=2, dp=2, zero=1, schedule=Schedule.ZERO_BUBBLE,
                                       global_batch=8, num_microbatches=4)),
        # V placement: rank 0 holds chunks 0 and 3 (the embedding and its tied head), rank 1
        # chunks 1 and 2
        Layout("zbv_pp2_dp2", gpt, plan(gpt, pp=2, dp=2, vpp=2, schedule=Schedule.ZBV,
                                        global_batch=8, num_microbatches=4)),
        Layout("dualpipev_pp2_dp2", gpt, plan(gpt, pp=2, dp=2, vpp=2, zero=1,
                                              schedule=Schedule.DUALPIPEV, global_batch=8,
                                              num_microbatches=4)),
        Layout("zero3_tp2_dp2", gpt, plan(gpt, tp=2, dp=2, zero=3, global_batch=8,
                                          num_microbatches=2, micro_batch=2)),
        Layout("tp4_sp", gpt, plan(gpt, tp=4, sequence_parallel=True, global_batch=4,
                                   num_microbatches=2, micro_batch=2)),
        Layout("zb_pp2_dp2_replicate", gpt,
               plan(gpt, pp=2, dp=2, schedule=Schedule.ZERO_BUBBLE, global_batch=8,
                    num_microbatches=4)),
        Layout("tp2_sp_dp2_odd_vocab", odd_vocab,
               plan(odd_vocab, tp=2, dp=2, zero=3, sequence_parallel=True, global_batch=4,
                    num_microbatches=2)),
        Layout("llama_gqa_tp2_pp2", llama, plan(llama, tp=2, pp=2, sequence_parallel=True,
                                                global_batch=4, num_microbatches=2,
                                                micro_batch=2)),
        # mixed precision: fp32 master weights, bf16 compute
        Layout("bf16_dp4", gpt, plan(gpt, "bf16", dp=4, global_batch=8, num_microbatches=2)),
        Layout("bf16_zero3_dp4", gpt, plan(gpt, "bf16", dp=4, zero=3, global_batch=8,
                                           num_microbatches=2)),
        Layout("bf16_tp2_dp2", llama, plan(llama, "bf16", tp=2, dp=2, global_batch=4,
                                           num_microbatches=2)),
    ]


def _uneven_model(seq_len: int) -> ModelSpec:
    return build_transformer(TransformerShape(name=f"gpt-uneven-{seq_len}", arch="gpt",
                                              num_layers=2, hidden_size=20, num_heads=4,
                                              vocab_size=61, seq_len=seq_len, padded_vocab_size=61))


def uneven_layouts() -> list[Layout]:
    """Layouts whose dim-0 shards are uneven: 5 position rows over dp 4 are 2, 2, 1, 0 rows
    (FSDP2 pads each to 2), 7 are 2, 2, 2, 1; 61 vocabulary rows, which tp 2 does not divide,
    stay whole on both tp ranks and split 31, 30 over dp 2; ZeRO-1 over dp 4 with 5 rows leaves
    one rank an empty shard (``uneven_zero1_dp4_empty_shard``), which its bucketed all-gather
    must carry."""
    def plan(model: ModelSpec, **kw: Any) -> Plan:
        return even_plan(model, global_batch=4, **kw)
    five, seven = _uneven_model(5), _uneven_model(7)
    return [Layout("uneven_zero3_dp4", five, plan(five, dp=4, zero=3)),
            Layout("uneven_zero1_dp4", seven, plan(seven, dp=4, zero=1)),
            Layout("uneven_zero2_tp2_dp2", five, plan(five, tp=2, dp=2, zero=2, micro_batch=2)),
            Layout("uneven_zero1_dp4_empty_shard", five, plan(five, dp=4, zero=1))]


def batches(layout: Layout, steps: int = STEPS) -> list[torch.Tensor]:
    """``steps`` global batches of tokens, LongTensor[global_batch, s + 1]."""
    return token_batches(layout.model, layout.plan.global_batch, steps)


# --- the live shards against Layout ---------------------------------------------------------------

def _box_of(tensor: torch.Tensor) -> tuple[list[int], list[int], torch.Tensor]:
    """(global offset, local shape, local tensor) of a DTensor's or a plain tensor's shard."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(tensor, DTensor):
        return [0] * tensor.ndim, list(tensor.shape), tensor.detach()
    local = tensor._local_tensor.detach()
    _, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh,
                                                      tensor.placements)
    return list(offset), list(local.shape), local


class LiveLayoutCheck:
    """One rank's shards of a live engine against ``layout_of``: the key set, every parameter's
    box (shape, global offset from the DTensor placements, the values its initialisation gives
    that box, and under FSDP2 the padded rows it allocates) before the first step, and after it
    every AdamW moment's box and again every parameter's, and the small state (step counter, LR
    schedule, RNG stream). ``before`` on the fresh engine, ``after_step`` after its first step,
    then ``found``."""

    def __init__(self, layout: Layout, rank: int) -> None:
        from meshmorph.elastic.moves.layout import layout_of

        self.start = time.perf_counter()
        self.layout, self.rank = layout, rank
        self.pieces = {p.key: p for p in layout_of(layout.model, layout.plan).held[rank]}
        self.found: dict[str, Any] = {"rank": rank, "mismatch": []}
        self.boxes: set[str] = set()
        self.values: set[str] = set()
        self.padded: set[str] = set()
        self.params: dict[int, str] = {}
        self.live: set[str] = set()

    def _compare(self, key: str, tensor: torch.Tensor) -> torch.Tensor | None:
        plan = self.layout.plan
        offset, shape, local = _box_of(tensor)
        piece = self.pieces.get(key)
        self.live.add(key)
        if piece is None:
            return None
        if shape != list(piece.box.length) or (piece.box.numel
                                               and offset != list(piece.box.offset)):
            self.found["mismatch"].append(f"{key}: live offset {offset} shape {shape}, Layout "
                                          f"{list(piece.box.offset)} {list(piece.box.length)}")
            return None
        if key.startswith("param/") and plan.zero >= 2 and plan.dp > 1:  # FSDP2's padded shard
            rows = piece.box.length[0] + piece.pad_rows
            held = local.untyped_storage().nbytes() // local.element_size()
            if held != rows * piece.box.row_numel():
                self.found["mismatch"].append(f"{key}: FSDP2 allocates {held} elements, Layout "
                                              f"says {rows} rows of {piece.box.row_numel()}")
                return None
            self.padded.add(key)
        self.boxes.add(key)
        return local

    def before(self, engine: Any) -> None:
        import torch.distributed as dist

        from meshmorph.elastic.moves.layout import param_fqn
        from meshmorph.run.model.decoder import init_value, layer_of

        spec, plan = self.layout.model, self.layout.plan
        mesh = engine.train_mesh
        if plan.rank_of(mesh.pp_rank, mesh.dp_rank, mesh.tp_rank) != dist.get_rank():
            self.found["mismatch"].append(
                "the mesh coordinates do not give this rank under Plan.rank_of")
        for part in engine.model_parts:
            for name, param in part.named_parameters(remove_duplicate=False):
                layer, inner = layer_of(spec, name)
                fqn = param_fqn(spec, layer, inner)
                self.params[id(param)] = fqn
                local = self._compare(f"param/{fqn}", param)
                if local is None:
                    continue
                box = self.pieces[f"param/{fqn}"].box
                value = init_value(spec, layer, inner, tuple(param.shape), seed=SEED,
                                   box=box.slices())
                if not torch.equal(local.float(), value):
                    self.found["mismatch"].append(f"param/{fqn}: the live shard holds other "
                                                  f"values than box {box} of the initial tensor")
                else:
                    self.values.add(f"param/{fqn}")

    def after_step(self, engine: Any) -> dict[str, Any]:
        from meshmorph.elastic.moves.layout import MOMENTS, RNG_STATE_BYTES

        for part in engine.model_parts:  # the same boxes at the step boundary (ZeRO-2 resharded)
            for name, param in part.named_parameters(remove_duplicate=False):
                if self._compare(f"param/{self.params[id(param)]}", param) is None:
                    self.found["mismatch"].append(f"{name}: another box after the step")
        for optimizer in engine.optimizers:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    state = optimizer.state.get(param, {})
                    for moment in MOMENTS:
                        if moment in state:
                            self._compare(f"{moment}/{self.params[id(param)]}", state[moment])
                    if "step" in state:
                        self.live.add("step")
        if engine.lr_schedulers:
            self.live.add("lr_scheduler")
        if torch.get_rng_state().numel() == RNG_STATE_BYTES:
            self.live.add(f"rng/{self.rank}")
        self.live.add("data")  # the data position lives in the trainer's loader, not the engine
        found = dict(self.found)
        found["only_live"] = sorted(self.live - set(self.pieces))
        found["only_layout"] = sorted(set(self.pieces) - self.live)
        found["boxes"], found["values"] = sorted(self.boxes), sorted(self.values)
        found["padded"] = sorted(self.padded)
        found["seconds"] = time.perf_counter() - self.start
        return found


def _train_and_check(layout: Layout, rank: int, out: Path) -> None:
    """Build the layout's engine, check its shards against Layout around the first step (to
    ``live-rank<r>.json``), and train ``STEPS`` steps (``harness.train_and_report``)."""
    from meshmorph.run.engine.train_engine import build_engine

    check = LiveLayoutCheck(layout, rank)
    engine = build_engine(layout.model, layout.plan, OPTIM, seed=SEED, device=torch.device("cpu"))
    check.before(engine)

    def after_first(index: int) -> None:
        if index == 1:
            (out / f"live-rank{rank}.json").write_text(json.dumps(check.after_step(engine)))

    train_and_report(engine, layout.plan, batches(layout), out, rank, before_step=after_first)


def _check_only(layout: Layout, rank: int, out: Path) -> None:
    """Build the layout's engine and check its shards against Layout around one step."""
    from meshmorph.run.engine.train_engine import build_engine

    check = LiveLayoutCheck(layout, rank)
    engine = build_engine(layout.model, layout.plan, OPTIM, seed=SEED, device=torch.device("cpu"))
    check.before(engine)
    share = layout.plan.global_batch // layout.plan.dp
    engine.step(batches(layout, 1)[0][engine.dp_rank * share:(engine.dp_rank + 1) * share])
    (out / f"live-rank{rank}.json").write_text(json.dumps(check.after_step(engine)))


def matrix_part(rank: int, world_size: int, out: Path) -> None:
    """Every matrix layout in turn: train and check (``_train_and_check``)."""
    from functools import partial

    each_case(rank, out, [(layout.name, partial(_train_and_check, layout, rank))
                          for layout in layouts()])


def uneven_part(rank: int, world_size: int, out: Path) -> None:
    """Every uneven layout in turn: check the shards around one step."""
    from functools import partial

    each_case(rank, out, [(layout.name, partial(_check_only, layout, rank))
                          for layout in uneven_layouts()])


MATRIX_PART = Part("equivalence_matrix", matrix_part, world=WORLD, timeout_s=420)
UNEVEN_PART = Part("layout_live_uneven", uneven_part, world=WORLD, timeout_s=120)
