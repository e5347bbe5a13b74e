"""Pipeline transfers of the per-rank prediction (cost/rank_state.py) under the three chunk
placements: one chunk per rank, looped (interleaved, chunk c on rank c mod pp) and the V of zbv
and dualpipev (rank r holds chunks r and 2pp - 1 - r). torch pipelining sends a micro-batch's
hidden state forward and its gradient back, and a 4-byte handshake in the first step, only
between chunks on different ranks; the V's turn (chunks pp - 1 and pp, both on rank pp - 1)
passes them as local inputs. Figures worked out by hand for seq 16, micro-batch 1, fp32: one
hidden state is 16 x h x 4 bytes (4,096 for h 64, 2,048 for h 32)."""

from __future__ import annotations

import pytest

from meshmorph.cost.rank_state import predict_rank_state, remote_neighbours
from meshmorph.spec.catalog import catalog_model
from meshmorph.spec.model import ModelSpec
from meshmorph.spec.plan import Plan
from meshmorph.spec.transformer import TransformerShape, build_transformer

SEQ = 16
HANDSHAKE = 4


def _deep() -> ModelSpec:
    """8 blocks (10 layers): every chunk of pp 4 x vpp 2 holds at least one."""
    return build_transformer(TransformerShape(name="gpt-deep", arch="gpt", num_layers=8,
                                              hidden_size=32, num_heads=4, vocab_size=128,
                                              seq_len=SEQ))


def _plan(model: ModelSpec, **kw: object) -> Plan:
    fields: dict[str, object] = {"dtype": "fp32", "vpp": 2, **kw}
    fields.setdefault("global_batch", int(fields.get("dp", 1)) * int(fields["num_microbatches"]))  # type: ignore[call-overload]
    return Plan(model=model.name, seq_len=SEQ, **fields).with_even_stages(model)  # type: ignore[arg-type]


def _send_recv(model: ModelSpec, plan: Plan, rank: int) -> float:
    return predict_rank_state(model, plan, rank)["comm_bytes"]["send_recv"]  # type: ignore[index]


def _per_neighbour(plan: Plan, hidden: int) -> int:
    """What one rank sends one neighbouring chunk on another rank in a first step."""
    return HANDSHAKE + plan.num_microbatches * SEQ * hidden * 4


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_the_turn_of_a_v_sends_nothing_between_its_two_chunks(schedule: str) -> None:
    llama = catalog_model("llama-tiny", seq_len=SEQ)
    plan = _plan(llama, pp=2, dp=2, schedule=schedule, num_microbatches=4)
    one = _per_neighbour(plan, 64)  # 4 + 4 x 4,096 = 16,388
    # pipeline rank 1 (global ranks 2 and 3) holds chunks 1 and 2: chunk 1 sends gradients to
    # chunk 0 on rank 0, chunk 2 activations to chunk 3 on rank 0; 1 -> 2 stays on the rank
    assert _send_recv(llama, plan, 2) == _send_recv(llama, plan, 3) == 2 * one == 32_776
    # pipeline rank 0 holds chunks 0 and 3: one neighbour each, both on rank 1
    assert _send_recv(llama, plan, 0) == 2 * one


def test_a_pp4_v_prices_four_remote_neighbours_inside_and_two_at_its_ends() -> None:
    deep = _deep()
    plan = _plan(deep, pp=4, schedule="dualpipev", num_microbatches=8)
    one = _per_neighbour(plan, 32)  # 4 + 8 x 2,048 = 16,388
    # rank 0: chunks 0 and 7 (one neighbour each); ranks 1, 2: chunks 1, 6 and 2, 5 (two each);
    # rank 3: chunks 3 and 4, the turn (one remote neighbour each)
    assert [_send_recv(deep, plan, r) for r in range(4)] == [2 * one, 4 * one, 4 * one, 2 * one]


def test_interleaved_chunks_send_across_every_boundary() -> None:
    gpt = catalog_model("gpt-tiny", seq_len=SEQ)
    plan = _plan(gpt, pp=2, dp=2, schedule="interleaved", num_microbatches=4)
    one = _per_neighbour(plan, 64)
    # rank 0: chunks 0 (one neighbour) and 2 (two); rank 1: chunks 1 (two) and 3 (one)
    assert _send_recv(gpt, plan, 0) == _send_recv(gpt, plan, 2) == 3 * one


@pytest.mark.parametrize(("schedule", "pp"), [("zbv", 2), ("dualpipev", 4), ("interleaved", 2),
                                              ("interleaved", 4), ("1f1b", 4)])
def test_every_send_crosses_one_remote_boundary(schedule: str, pp: int) -> None:
    """Summed over the pipeline ranks, the sends are two per boundary between chunks on
    different ranks (activation forward, gradient back): all boundaries but the V's turn."""
    deep = _deep()
    vpp = 1 if schedule == "1f1b" else 2
    plan = _plan(deep, pp=pp, vpp=vpp, schedule=schedule, num_microbatches=2 * pp)
    local = sum(plan.pp_rank_of_chunk(c) == plan.pp_rank_of_chunk(c + 1)
                for c in range(plan.num_chunks - 1))
    assert local == (1 if schedule in ("zbv", "dualpipev") else 0)
    total = sum(_send_recv(deep, plan, plan.rank_of(r, 0, 0)) for r in range(pp))
    assert total == 2 * (plan.num_chunks - 1 - local) * _per_neighbour(plan, 32)


def test_remote_neighbours_of_the_v_and_the_loop() -> None:
    deep = _deep()
    v = _plan(deep, pp=4, schedule="zbv", num_microbatches=8)
    assert [remote_neighbours(v, c) for c in range(8)] == [1, 2, 2, 1, 1, 2, 2, 1]
    looped = _plan(deep, pp=4, schedule="interleaved", num_microbatches=8)
    assert [remote_neighbours(looped, c) for c in range(8)] == [1, 2, 2, 2, 2, 2, 2, 1]


def test_a_v_keeps_two_tied_copies_on_rank_0_and_sums_them_without_a_collective() -> None:
    """gpt-tiny (a block 49,984 parameters, the embedding 256 x 64 + 16 x 64 = 17,408, the head's
    norm 128 and its tied 256 x 64 = 16,384 weight) over pp 2 x vpp 2: pipeline rank 0 holds
    chunk 0 (embedding, block 1) and chunk 3 (block 4, head). The head's weight is a parameter of
    its own chunk, so the rank holds, reduces over dp and updates both copies, and their
    gradients are summed on the rank."""
    gpt = catalog_model("gpt-tiny", seq_len=SEQ)
    elements = 17_408 + 2 * 49_984 + 128 + 16_384  # 133,888
    for schedule in ("zbv", "dualpipev"):
        plan = _plan(gpt, pp=2, dp=2, schedule=schedule, num_microbatches=4)
        state = predict_rank_state(gpt, plan, 0)
        assert (state["params_bytes"], state["grads_bytes"], state["optimizer_bytes"]) == (
            4 * elements, 4 * elements, 8 * elements)
        # DDP's gradients, the loss and the norm over pp: no all-reduce of the tied gradient
        assert state["comm_bytes"]["all_reduce"] == 4 * elements + 8 + 8  # type: ignore[index]
    # looped placement: the head is on rank 1, the embedding on rank 0, and both ranks
    # all-reduce the tied gradient (4 x 16,384 bytes) over the pair
    looped = _plan(gpt, pp=2, dp=2, schedule="interleaved", num_microbatches=4)
    for rank in (0, 2):
        state = predict_rank_state(gpt, looped, rank)
        assert state["comm_bytes"]["all_reduce"] == (  # type: ignore[index]
            state["grads_bytes"] + 4 * 16_384 + 8 + 8)


def test_a_v_under_fsdp_shards_both_tied_copies() -> None:
    gpt = catalog_model("gpt-tiny", seq_len=SEQ)
    plan = _plan(gpt, pp=2, dp=2, zero=2, schedule="zbv", num_microbatches=4)
    state = predict_rank_state(gpt, plan, 0)
    # every dim-0 of rank 0's tensors is even: half of 133,888 elements each, and the norm's
    # class sums over dp join the loss and the norm over pp
    assert state["params_bytes"] == state["grads_bytes"] == 4 * 133_888 // 2
    assert state["comm_bytes"]["all_reduce"] == 8 + 32 + 8  # type: ignore[index]


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev", "interleaved"])
def test_the_planners_rank_memory_holds_what_the_state_line_predicts(schedule: str) -> None:
    """CostModel.rank_memory's fp32 ZeRO-0 parameters (4 bytes each) on every pipeline rank are
    the state prediction's ``params_bytes``: the V's rank 0 holds both tied copies there too."""
    from meshmorph.cost.model import CostModel
    from meshmorph.spec.cluster import parse_cluster

    gpt = catalog_model("gpt-tiny", seq_len=SEQ)
    plan = _plan(gpt, pp=2, dp=2, schedule=schedule, num_microbatches=4)
    cost = CostModel(gpt, parse_cluster("cpu:1x4"))
    for pp_rank in range(plan.pp):
        chunks = [(plan.stages[c].start, plan.stages[c].stop, plan.stages[c].recompute)
                  for c in plan.chunks_of(pp_rank)]
        memory = cost.rank_memory(plan, pp_rank, chunks, cost.default_gpu())
        state = predict_rank_state(gpt, plan, plan.rank_of(pp_rank, 0, 0))
        assert memory.params == state["params_bytes"]
