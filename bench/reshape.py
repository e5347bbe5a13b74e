"""Reshape a running job three ways, side by side: in memory along the MovePlan, through a DCP
checkpoint (what ``meshmorph run --resume --reshard`` does), and by gathering the whole state on
one process and scattering it.

4 gloo processes on CPU, a GPT whose training state (fp32 parameters and both AdamW moments)
is 177 MB. For each scenario every path starts from the same engine of Plan A after one
training step and ends with an engine of Plan B ready for its next step; the figure is the wall
time from the change (Plan A's ranks agree to move) to the moment every rank of Plan B holds its
state, beside the bytes each path moves. The in-memory path also reports the MovePlan's bytes
against the lower bound and a rank-order (Megatron-style) placement, the busiest device's
bytes, and the predicted move time against the measured wall time: its coefficients are
measured on the 4 processes right before each in-memory move (``elastic/live/move_calibrate.py``;
every coefficient is a primitive, never a move or an engine build: Plan B's build is priced
from its counts, ``elastic/moves/build_counts.py``), and the ratio is each repeat's prediction over
that repeat's wall time, median over repeats. The prediction and the measurement are both
broken into the move's parts (extract, group, plan, agree, transfer, group_b, build, install:
the slowest process's lap in each), so the results show which part is off. The three
paths take turns going first in a scenario (the load drifts). Every path's per-tensor hashes
after the move are checked against those before it.

Run: ``python bench/reshape.py --repeats 3`` (about 15 minutes on 2 shared cores); writes
bench/results/latest/reshape.json (``--out PATH`` to choose, ``--update`` for the committed
bench/results/reshape.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.helpers: the spawn harness

from tests.helpers.spawn import spawn  # noqa: E402

from results_path import Outputs, wrote  # noqa: E402

OUTPUTS = Outputs("bench/results/reshape.json")

SHAPE = dict(name="gpt-reshape-bench", arch="gpt", num_layers=4, hidden_size=512, num_heads=8,
             vocab_size=2048, seq_len=16)
"""About 10.5 M parameters: 126 MB of fp32 parameters and AdamW moments."""
GLOBAL_BATCH = 8
SCENARIOS = {  # name: (plan A kwargs, plan B kwargs, processes staying, joining)
    "zero3_dp4_to_zero3_dp2_leave": (dict(dp=4, zero=3, num_microbatches=2),
                                     dict(dp=2, zero=3, num_microbatches=4), (0, 1), ()),
    "zero3_dp2_to_zero3_dp4_join": (dict(dp=2, zero=3, num_microbatches=4),
                                    dict(dp=4, zero=3, num_microbatches=2), None, (2, 3)),
    "tp2_dp2_to_pp2_dp2": (dict(tp=2, dp=2, micro_batch=2, num_microbatches=2),
                           dict(pp=2, dp=2, num_microbatches=4), None, ()),
    "pp2_tp2_to_zero3_dp4": (dict(pp=2, tp=2, micro_batch=2, num_microbatches=4),
                             dict(dp=4, zero=3, num_microbatches=2), None, ()),
    "zero3_dp4_to_tp2_pp2": (dict(dp=4, zero=3, num_microbatches=2),
                             dict(tp=2, pp=2, micro_batch=2, num_microbatches=4), None, ()),
}
PATHS = ("in_memory", "dcp", "gather_scatter")


def _model():  # type: ignore[no-untyped-def]
    from meshmorph.spec.transformer import TransformerShape, build_transformer

    return build_transformer(TransformerShape(**SHAPE))


def _plan(model, kw):  # type: ignore[no-untyped-def]
    from meshmorph.spec.plan import Plan

    return Plan(model=model.name, seq_len=model.seq_len, global_batch=GLOBAL_BATCH,
                dtype="fp32", **kw).with_even_stages(model)


def _gather_scatter(me, engine, model, plan_a, plan_b, procs_a, procs_b, small):  # type: ignore[no-untyped-def]
    """Every distinct box to process 0, assembled whole there, each new rank's boxes back out."""
    import torch

    from meshmorph.elastic.live.execute import execute_transfers, is_tensor_key
    from meshmorph.elastic.live.local_state import HeldPiece, extract_state, fill_box_
    from meshmorph.elastic.moves.layout import layout_of
    from meshmorph.elastic.moves.move_plan import Transfer

    la, lb = layout_of(model, plan_a), layout_of(model, plan_b)
    shapes = {k: t.shape for k, t in la.tensors.items()}
    held = extract_state(engine, consumed_samples=0).pieces if engine else {}
    gather, seen = [], set()
    for rank in range(plan_a.world_size):
        for p in la.held[rank]:
            if is_tensor_key(p.key) and p.box.numel and (p.key, p.box) not in seen:
                seen.add((p.key, p.box))
                gather.append(Transfer(procs_a[rank], 0, p.key, p.box, p.box.numel * 4))
    members = sorted(set(procs_a) | set(procs_b) | {0})
    ranks = {p: members.index(p) for p in members}
    got, report_g = execute_transfers(gather, me, held, shapes, rank_of_device=ranks,
                                      verify=False)
    whole: dict = {}
    if me == 0:
        pieces: dict = {}
        for piece in [*got, *(q for ps in held.values() for q in ps)]:
            pieces.setdefault(piece.key, []).append(piece)
        for key in {t.key for t in gather}:
            full = torch.empty(shapes[key])
            fill_box_(full, (0,) * full.dim(), pieces[key])
            whole[key] = [HeldPiece(key, (0,) * full.dim(), tuple(full.shape), full)]
    scatter = [Transfer(0, procs_b[r], p.key, p.box, p.box.numel * 4)
               for r in range(plan_b.world_size) for p in lb.held[r]
               if is_tensor_key(p.key) and p.box.numel and procs_b[r] != 0]
    out, report_s = execute_transfers(scatter, me, whole, shapes, rank_of_device=ranks,
                                      verify=False)
    for r in range(plan_b.world_size) if me == 0 else ():
        if procs_b[r] != 0:
            continue
        for piece in lb.held[r]:  # process 0's own new rank: cut from the whole tensors
            if is_tensor_key(piece.key) and piece.box.numel:
                full = whole[piece.key][0].tensor
                out.append(HeldPiece(piece.key, piece.box.offset, tuple(full.shape),
                                     full[piece.box.slices()]))
    return out, report_g.sent_bytes + report_s.sent_bytes


def _one(rank, name, path, out, tmp, time_model):  # type: ignore[no-untyped-def]
    import torch
    import torch.distributed as dist

    from meshmorph.elastic.live.controller import ReshapeRequest, regroup, reshape_in_memory
    from meshmorph.elastic.live.execute import merge_pieces
    from meshmorph.elastic.live.local_state import extract_state, install_state, state_hashes
    from meshmorph.run.checkpoint import load_checkpoint, save_checkpoint, verify_checkpoint
    from meshmorph.run.config import OptimConfig
    from meshmorph.run.engine.train_engine import build_engine

    model, optim = _model(), OptimConfig(lr=1e-3, warmup_steps=1, decay_steps=10)
    kw_a, kw_b, staying, joining = SCENARIOS[name]
    plan_a, plan_b = _plan(model, kw_a), _plan(model, kw_b)
    procs_a = tuple(p for p in range(4) if p not in joining)[:plan_a.world_size]
    tag = f"{name}-{path}"
    print(f"{tag}: plan A on processes {procs_a}", flush=True)
    engine, before, small = None, None, None
    tokens = torch.randint(0, model.vocab_size, (GLOBAL_BATCH, model.seq_len + 1),
                           generator=torch.Generator().manual_seed(5))
    if regroup(out, f"{tag}-a", rank, procs_a):
        engine = build_engine(model, plan_a, optim, seed=3, device=torch.device("cpu"))
        share = GLOBAL_BATCH // engine.dp_size
        engine.step(tokens[engine.dp_rank * share:(engine.dp_rank + 1) * share])
        small = extract_state(engine, consumed_samples=GLOBAL_BATCH).small
        before = state_hashes(engine, small)
        dist.barrier()
    start = time.time()  # the change: every rank of plan A is at the step boundary
    figures: dict = {}
    if path == "in_memory":
        request = ReshapeRequest(model=model, optim=optim, plan_a=plan_a, processes_a=procs_a,
                                 plan_b=plan_b, staying=staying, joining=joining, seed=3,
                                 time_model=time_model)
        called = time.time()  # a joining process calls before the change and waits for it
        new, report = reshape_in_memory(request, rank, engine, consumed_samples=GLOBAL_BATCH,
                                        store_dir=out, tag=tag)
        procs_b = report.processes_b
        figures = {**report.figures(), "sent": report.move.sent_bytes(),
                   "transfer_s": report.times_s.get("transfer", 0.0),
                   "predicted_terms": asdict(report.predicted) if report.predicted else {}}
    else:
        procs_b = tuple(range(plan_b.world_size)) if staying is None else tuple(staying)
        ckpt = Path(tmp) / tag
        if path == "dcp":
            if engine is not None:
                save_checkpoint(engine, ckpt, step=1, consumed_samples=GLOBAL_BATCH,
                                plan=plan_a.to_dict(), keep=1)
            regroup(out, f"{tag}-x", rank, sorted(set(procs_a) | set(procs_b)))
            dist.barrier()  # the checkpoint is committed before anyone loads it
            figures["sent"] = sum(f.stat().st_size for f in (ckpt / "step-1").iterdir())
        else:
            regroup(out, f"{tag}-x", rank, sorted(set(procs_a) | set(procs_b) | {0}))
            received, sent = _gather_scatter(rank, engine, model, plan_a, plan_b, procs_a, procs_b,
                                             small)
            figures["sent"] = sent
            box = [small]
            dist.broadcast_object_list(box, src=sorted(set(procs_a) | set(procs_b) | {0})
                                       .index(procs_a[0]))
            small = box[0]
            dist.barrier()
        new = None
        if regroup(out, f"{tag}-b", rank, procs_b):
            new = build_engine(model, plan_b, optim, seed=3, device=torch.device("cpu"))
            if path == "dcp":
                load_checkpoint(new, verify_checkpoint(ckpt / "step-1"))
            else:
                install_state(new, merge_pieces(received), small)
    if new is not None:
        dist.barrier()
        end = time.time()
        if path == "in_memory":  # the slowest new rank's time in each part of the move
            laps: list = [None] * dist.get_world_size()
            dist.all_gather_object(laps, (called, rank in procs_a, report.times_s))
            change = max(c for c, in_a, _ in laps if in_a)  # plan A's last process at the change
            for c, in_a, lap in laps:  # a joiner's wait for the change is not the move's
                if not in_a:
                    lap["group"] = max(lap.get("group", 0.0) - max(change - c, 0.0), 0.0)
            figures["slowest_laps_s"] = {k: max(lap[2].get(k, 0.0) for lap in laps)
                                         for k in laps[0][2]}
        after = state_hashes(new, extract_state(new, consumed_samples=GLOBAL_BATCH).small)
        if dist.get_rank() == 0:
            (out / f"{tag}.json").write_text(json.dumps({"end": end, **figures, "after": after}))
    if before is not None and rank == procs_a[0]:
        (out / f"{tag}.before.json").write_text(json.dumps(before))
        (out / f"{tag}.start").write_text(str(start))
    if rank == 0 and path == "dcp":
        shutil.rmtree(Path(tmp) / tag, ignore_errors=True)


def job(rank: int, world_size: int, out_dir: str, repeats: int) -> None:
    import gc

    from meshmorph.elastic.live.controller import regroup
    from meshmorph.elastic.live.move_calibrate import calibrate_move_time

    tmp = Path(out_dir) / "checkpoints"  # on the same file system as every run folder
    for repeat in range(repeats):
        for name in SCENARIOS:
            sub = Path(out_dir) / f"r{repeat}"
            sub.mkdir(exist_ok=True)
            # the paths take turns going first (the load drifts within a scenario too)
            for path in PATHS[repeat % len(PATHS):] + PATHS[:repeat % len(PATHS)]:
                time_model = None
                if path == "in_memory":
                    # the move-time coefficients, measured on the 4 processes right before the
                    # move (the machine is shared: its load, and every rate, changes by the minute)
                    regroup(sub, f"{name}-calibrate", rank, list(range(world_size)))
                    time_model = calibrate_move_time(model=_model(), store_dir=sub,
                                                     tag=f"{name}-regroup")
                    if rank == 0:
                        (sub / f"{name}.time_model.json").write_text(
                            json.dumps(asdict(time_model)))
                _one(rank, name, path, sub, tmp, time_model)
                gc.collect()
    regroup(Path(out_dir), "end", rank, list(range(world_size)))


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _parts(runs: list[dict]) -> dict:
    """Per part of the move: the predicted and the measured seconds (the slowest process's lap)
    of each repeat, and their medians."""
    from meshmorph.elastic.moves.move_time import PARTS

    out = {}
    for part in PARTS:
        predicted = [r["predicted_terms"]["parts"].get(part, 0.0) for r in runs]
        measured = [r["slowest_laps_s"].get(part, 0.0) for r in runs]
        out[part] = {"predicted_s": _median(predicted), "measured_s": _median(measured),
                     "predicted_runs_s": predicted, "measured_runs_s": measured}
    return out


def collect(out: Path, repeats: int) -> dict:
    """Per scenario and path: median wall time, bytes, hashes kept; MovePlan figures."""
    results: dict = {}
    for name in SCENARIOS:
        row: dict = {}
        predicted: list[float] = []
        for path in PATHS:
            walls, kept, last, runs = [], True, {}, []
            for repeat in range(repeats):
                sub, tag = out / f"r{repeat}", f"{name}-{path}"
                last = json.loads((sub / f"{tag}.json").read_text())
                runs.append(last)
                walls.append(last["end"] - float((sub / f"{tag}.start").read_text()))
                before = json.loads((sub / f"{tag}.before.json").read_text())
                kept &= before == last["after"]
                if path == "in_memory":
                    predicted.append(last["predicted_time_s"])
            row[path] = {"wall_s": _median(walls), "walls_s": walls, "hashes_equal": kept,
                         "bytes": (sum(last["sent"].values()) if isinstance(last["sent"], dict)
                                   else last["sent"])}
            if path == "in_memory":
                row[path].update({k: last[k] for k in (
                    "bytes_moved", "lower_bound_bytes", "naive_bytes", "busiest_device_bytes",
                    "messages", "predicted_time_s", "measured_transfer_s", "measured_time_s",
                    "predicted_terms", "slowest_laps_s")})
                row[path]["parts_s"] = _parts(runs)
        mem, dcp = row["in_memory"], row["dcp"]
        row["in_memory_over_dcp"] = mem["wall_s"] / dcp["wall_s"]
        # per repeat: that repeat's prediction over that repeat's wall time; then the median
        ratios = [p / w for p, w in zip(predicted, mem["walls_s"], strict=True)]
        mem["predicted_s"] = predicted
        row["predicted_over_measured_s"] = ratios
        row["predicted_over_measured"] = _median(ratios)
        results[name] = row
    return results


def print_table(results: dict, state_mb: float) -> None:
    print(f"reshape on 4 gloo processes, {state_mb:.0f} MB of state (params + AdamW moments)")
    head = (f"{'scenario':32} {'moved MB':>9} {'bound MB':>9} {'naive MB':>9} {'busiest':>8} "
            f"{'mem s':>6} {'dcp s':>6} {'g+s s':>6} {'mem/dcp':>8} {'pred s':>7} {'pred/mem':>8}")
    print(head)
    for name, row in results.items():
        mem = row["in_memory"]
        print(f"{name:32} {mem['bytes_moved'] / 1e6:9.1f} {mem['lower_bound_bytes'] / 1e6:9.1f} "
              f"{mem['naive_bytes'] / 1e6:9.1f} {mem['busiest_device_bytes'] / 1e6:8.1f} "
              f"{mem['wall_s']:6.2f} {row['dcp']['wall_s']:6.2f} "
              f"{row['gather_scatter']['wall_s']:6.2f} {row['in_memory_over_dcp']:8.2f} "
              f"{mem['predicted_time_s']:7.3f} {row['predicted_over_measured']:8.2f}")


def print_parts(results: dict) -> None:
    """Predicted / measured seconds of each part of the in-memory move (medians)."""
    from meshmorph.elastic.moves.move_time import PARTS

    print(f"{'part (pred/meas s)':32} " + " ".join(f"{p:>13}" for p in PARTS))
    for name, row in results.items():
        parts = row["in_memory"]["parts_s"]
        print(f"{name:32} " + " ".join(
            f"{parts[p]['predicted_s']:6.3f}/{parts[p]['measured_s']:6.3f}" for p in PARTS))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1, help="runs of every path (median)")
    OUTPUTS.add_args(parser)
    args = parser.parse_args()
    out = OUTPUTS.path(args)
    model = _model()
    state_bytes = 3 * 4 * sum(layer.params for layer in model.layers)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="reshape-bench-") as tmp:
        spawn(job, 4, (tmp, args.repeats), timeout_s=1800, collective_timeout_s=300)
        results = collect(Path(tmp), args.repeats)
        time_model = {name: json.loads((Path(tmp) / "r0" / f"{name}.time_model.json").read_text())
                      for name in SCENARIOS}
    load_after = os.getloadavg()
    print(f"load average (1/5/15 min) before {load_before}, after {load_after}")
    print_table(results, state_bytes / 1e6)
    print_parts(results)
    for name, terms in time_model.items():
        print(f"{name}: coefficients measured before its first repeat:",
              {k: f"{v:.3g}" for k, v in terms.items() if isinstance(v, float) and v})
    out.write_text(json.dumps({"model": SHAPE, "state_bytes": state_bytes,
                               "time_model_first_repeat": time_model,
                               "global_batch": GLOBAL_BATCH, "processes": 4,
                               "repeats": args.repeats,
                               "load_average_before": load_before,
                               "load_average_after": load_after, "scenarios": results}, indent=1) + "\n")
    wrote(out)


if __name__ == "__main__":
    main()
