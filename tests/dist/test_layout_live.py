"""Layout agrees with what the runtime really holds: for every layout of the equivalence matrix,
plus two whose rows dp does not divide, one spawned 4-process gloo job builds the engine, and
each rank compares Layout's pieces with its live local shards — the key set, every parameter's
box (shape, global offset from the DTensor placements, the values its initialisation gives that
box, and under FSDP2 the padded rows it allocates) and, after one step, every AdamW moment's box
and again every parameter's — and the small state (step counter, LR schedule, RNG stream)."""

from __future__ import annotations

import gc
import json
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from test_equivalence import OPTIM, SEED, layouts

from meshmorph.elastic.moves.layout import MOMENTS, RNG_STATE_BYTES, layout_of, param_fqn
from meshmorph.spec.plan import Plan
from meshmorph.spec.transformer import TransformerShape, build_transformer

WORLD = 4


def _uneven_model(seq_len: int) -> Any:
    return build_transformer(TransformerShape(name=f"gpt-uneven-{seq_len}", arch="gpt",
                                              num_layers=2, hidden_size=20, num_heads=4,
                                              vocab_size=61, seq_len=seq_len, padded_vocab_size=61))


def uneven_layouts() -> list[Any]:
    """Layouts whose dim-0 shards are uneven: 5 position rows over dp 4 are 2, 2, 1, 0 rows
    (FSDP2 pads each to 2), 7 are 2, 2, 2, 1; 61 vocabulary rows, which tp 2 does not divide,
    stay whole on both tp ranks and split 31, 30 over dp 2; ZeRO-1 over dp 4 with 5 rows leaves
    one rank an empty shard (``uneven_zero1_dp4_empty_shard``), which its bucketed all-gather
    must carry."""
    kind = type(layouts()[0])

    def plan(model: Any, **kw: Any) -> Plan:
        return Plan(model=model.name, seq_len=model.seq_len, dtype="fp32", global_batch=4,
                    **kw).with_even_stages(model)
    five, seven = _uneven_model(5), _uneven_model(7)
    return [kind("uneven_zero3_dp4", five, plan(five, dp=4, zero=3)),
            kind("uneven_zero1_dp4", seven, plan(seven, dp=4, zero=1)),
            kind("uneven_zero2_tp2_dp2", five, plan(five, tp=2, dp=2, zero=2, micro_batch=2)),
            kind("uneven_zero1_dp4_empty_shard", five, plan(five, dp=4, zero=1))]


RUNTIME_BUGS: dict[str, str] = {}
"""Layouts the runtime cannot run yet, with the reason (an expected failure each)."""


def all_layouts() -> list[Any]:
    return layouts() + uneven_layouts()


NAMES = [layout.name for layout in all_layouts()]


def first_batch(layout: Any) -> torch.Tensor:
    """One global batch of tokens, LongTensor[global_batch, s + 1]."""
    gen = torch.Generator().manual_seed(1234)
    return torch.randint(0, layout.model.vocab_size,
                         (layout.plan.global_batch, layout.model.seq_len + 1), generator=gen)


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


def check_rank(layout: Any, rank: int) -> dict[str, Any]:
    """Build the engine of one matrix layout and compare this rank's shards with Layout."""
    import torch.distributed as dist

    from meshmorph.run.engine.train_engine import build_engine
    from meshmorph.run.model.decoder import init_value, layer_of

    start = time.perf_counter()
    spec, plan = layout.model, layout.plan
    expected = layout_of(spec, plan)
    pieces = {p.key: p for p in expected.held[rank]}
    engine = build_engine(spec, plan, OPTIM, seed=SEED, device=torch.device("cpu"))
    found: dict[str, Any] = {"rank": rank, "mismatch": []}
    boxes: set[str] = set()
    values: set[str] = set()
    padded: set[str] = set()
    mesh = engine.train_mesh
    if plan.rank_of(mesh.pp_rank, mesh.dp_rank, mesh.tp_rank) != dist.get_rank():
        found["mismatch"].append("the mesh coordinates do not give this rank under Plan.rank_of")
    params: dict[int, str] = {}
    live: set[str] = set()

    def compare(key: str, tensor: torch.Tensor) -> torch.Tensor | None:
        offset, shape, local = _box_of(tensor)
        piece = pieces.get(key)
        live.add(key)
        if piece is None:
            return None
        if shape != list(piece.box.length) or (piece.box.numel and offset != list(piece.box.offset)):
            found["mismatch"].append(f"{key}: live offset {offset} shape {shape}, Layout "
                                     f"{list(piece.box.offset)} {list(piece.box.length)}")
            return None
        if key.startswith("param/") and plan.zero >= 2 and plan.dp > 1:  # FSDP2's padded shard
            rows = piece.box.length[0] + piece.pad_rows
            held = local.untyped_storage().nbytes() // local.element_size()
            if held != rows * piece.box.row_numel():
                found["mismatch"].append(f"{key}: FSDP2 allocates {held} elements, Layout says "
                                         f"{rows} rows of {piece.box.row_numel()}")
                return None
            padded.add(key)
        boxes.add(key)
        return local

    for part in engine.model_parts:
        for name, param in part.named_parameters(remove_duplicate=False):
            layer, inner = layer_of(spec, name)
            fqn = param_fqn(spec, layer, inner)
            params[id(param)] = fqn
            local = compare(f"param/{fqn}", param)
            if local is None:
                continue
            box = pieces[f"param/{fqn}"].box
            value = init_value(spec, layer, inner, tuple(param.shape), seed=SEED, box=box.slices())
            if not torch.equal(local.float(), value):
                found["mismatch"].append(f"param/{fqn}: the live shard holds other values than "
                                         f"box {box} of the initial tensor")
            else:
                values.add(f"param/{fqn}")
    share = plan.global_batch // plan.dp
    engine.step(first_batch(layout)[engine.dp_rank * share:(engine.dp_rank + 1) * share])
    for part in engine.model_parts:  # still the same boxes at the step boundary (ZeRO-2 resharded)
        for name, param in part.named_parameters(remove_duplicate=False):
            if compare(f"param/{params[id(param)]}", param) is None:
                found["mismatch"].append(f"{name}: another box after the step")
    for optimizer in engine.optimizers:
        for group in optimizer.param_groups:
            for param in group["params"]:
                state = optimizer.state.get(param, {})
                for moment in MOMENTS:
                    if moment in state:
                        compare(f"{moment}/{params[id(param)]}", state[moment])
                if "step" in state:
                    live.add("step")
    if engine.lr_schedulers:
        live.add("lr_scheduler")
    if torch.get_rng_state().numel() == RNG_STATE_BYTES:
        live.add(f"rng/{rank}")
    live.add("data")  # the data position lives in the trainer's loader, not in the engine
    found["only_live"] = sorted(live - set(pieces))
    found["only_layout"] = sorted(set(pieces) - live)
    found["boxes"], found["values"], found["padded"] = sorted(boxes), sorted(values), sorted(padded)
    found["seconds"] = time.perf_counter() - start
    return found


def job(rank: int, world_size: int, result_dir: str) -> None:
    import torch.distributed as dist

    for layout in all_layouts():
        try:
            found = check_rank(layout, rank)
        except Exception:
            found = {"rank": rank, "error": traceback.format_exc()}
        (Path(result_dir) / f"{layout.name}-rank{rank}.json").write_text(json.dumps(found))
        gc.collect()
        dist.barrier()


@pytest.fixture(scope="module")
def live_results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from spawn import spawn

    result_dir = tmp_path_factory.mktemp("layout-live")
    spawn(job, WORLD, (str(result_dir),), timeout_s=240, collective_timeout_s=60)
    return result_dir


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.xfail(reason=RUNTIME_BUGS[n], strict=True))
    if n in RUNTIME_BUGS else n for n in NAMES])
def test_layout_boxes_equal_the_live_shards_of_every_rank(name: str, live_results: Path) -> None:
    layout = next(layout for layout in all_layouts() if layout.name == name)
    expected = layout_of(layout.model, layout.plan)
    for rank in range(WORLD):
        found = json.loads((live_results / f"{name}-rank{rank}.json").read_text())
        assert "error" not in found, found.get("error")
        assert found["mismatch"] == [], f"rank {rank}: " + "\n".join(found["mismatch"])
        assert (found["only_live"], found["only_layout"]) == ([], []), f"rank {rank}"
        tensors = {p.key for p in expected.held[rank] if "/" in p.key and not p.key.startswith("rng/")}
        assert set(found["boxes"]) == tensors, f"rank {rank}: boxes not compared"
        params = {k for k in tensors if k.startswith("param/")}
        assert set(found["values"]) == params
        fsdp = layout.plan.zero >= 2 and layout.plan.dp > 1
        assert set(found["padded"]) == (params if fsdp else set())
