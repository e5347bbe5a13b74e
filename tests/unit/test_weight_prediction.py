"""Weight prediction, stashing, the guard and the asynchronous action lists on cases worked by
hand (no process group)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from meshmorph.run.async_pipe.actions import (
    Action,
    async_1f1b,
    drain_point,
    staleness,
    sync_1f1b,
    two_bw,
)
from meshmorph.run.async_pipe.config import AsyncPipelineConfig
from meshmorph.run.async_pipe.prediction import PredictionGuard, predict
from meshmorph.run.async_pipe.weights import WeightSource
from meshmorph.schedule.table import Schedule
from meshmorph.spec.plan import Plan, PlanError


def constant_gradient_steps(param: torch.Tensor, opt: torch.optim.Optimizer, grad: torch.Tensor,
                            steps: int) -> None:
    for _ in range(steps):
        param.grad = grad.clone()
        opt.step()


def test_momentum_sgd_prediction_equals_the_weights_after_s_constant_gradient_steps() -> None:
    torch.manual_seed(0)
    param = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(5, 3, dtype=torch.float64)
    opt = torch.optim.SGD([param], lr=0.05, momentum=0.9)
    # 400 steps: the momentum buffer reaches its fixed point g / (1 - 0.9) (0.9^400 ~ 5e-19)
    constant_gradient_steps(param, opt, grad, 400)
    torch.testing.assert_close(opt.state[param]["momentum_buffer"], grad / 0.1, rtol=1e-12, atol=0)
    for s in (1, 3, 7):
        predicted = predict([param], opt, "sgd", s)[0]
        constant_gradient_steps(param, opt, grad, s)
        torch.testing.assert_close(predicted, param.detach(), rtol=1e-12, atol=1e-12)
    assert not torch.equal(predict([param], opt, "sgd", 0)[0], predicted)


def test_adam_prediction_equals_the_weights_after_s_constant_gradient_steps() -> None:
    torch.manual_seed(1)
    param = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(4, 4, dtype=torch.float64)
    opt = torch.optim.Adam([param], lr=1e-2, betas=(0.9, 0.999), eps=1e-8)
    # with a constant gradient m_hat = g and v_hat = g^2 from the first step on
    constant_gradient_steps(param, opt, grad, 1)
    predicted = predict([param], opt, "adam", 5)[0]
    start = param.detach().clone()
    constant_gradient_steps(param, opt, grad, 5)
    torch.testing.assert_close(predicted, param.detach(), rtol=1e-12, atol=1e-12)
    # each Adam step moved every element by lr * g / (|g| + eps): about 5e-2 in all
    assert (predicted - start).abs().max().item() == pytest.approx(5e-2, rel=1e-6)


def test_prediction_before_the_first_step_returns_the_current_weights() -> None:
    param = torch.ones(3, requires_grad=True)
    for opt, rule in ((torch.optim.SGD([param], lr=0.1, momentum=0.9), "sgd"),
                      (torch.optim.Adam([param], lr=0.1), "adam")):
        assert torch.equal(predict([param], opt, rule, 4)[0], torch.ones(3))


def test_stash_returns_the_forward_weights_after_later_updates() -> None:
    param = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    source = WeightSource([param], torch.optim.SGD([param], lr=0.5))
    stashed = source.for_forward("stash")
    aliased = source.for_forward("alias")
    for _ in range(3):
        param.grad = torch.ones(3)
        source.step()
    assert stashed[0].tolist() == [1.0, 2.0, 3.0]  # what the forward used, exactly
    assert aliased[0].tolist() == [-0.5, 0.5, 1.5]  # unstashed: the backward sees the update
    assert source.version == 3
    # the backward through the stash gives the gradient at the forward's weights
    (stashed[0] ** 2).sum().backward()
    param.grad = torch.zeros(3)
    grads = source.add_grads(stashed)
    assert grads[0].tolist() == [2.0, 4.0, 6.0] and param.grad.tolist() == [2.0, 4.0, 6.0]
    assert stashed[0].grad is None


def test_two_bw_shares_one_copy_per_version() -> None:
    param = torch.zeros(2, requires_grad=True)
    source = WeightSource([param], torch.optim.SGD([param], lr=1.0))
    first, second = source.for_forward("2bw"), source.for_forward("2bw")
    assert first[0] is second[0]
    param.grad = torch.ones(2)
    source.step()
    third = source.for_forward("2bw")
    assert third[0] is not first[0]
    assert first[0].tolist() == [0.0, 0.0] and third[0].tolist() == [-1.0, -1.0]


def test_guard_trips_when_the_window_mean_error_ratio_passes_the_threshold() -> None:
    guard = PredictionGuard(threshold=0.5)
    now = [torch.tensor([1.0, 1.0])]
    forward = [torch.tensor([1.0, 5.0])]  # stale by 4
    assert guard.observe([torch.tensor([1.0, 2.0])], forward, now) == pytest.approx(0.25)
    assert guard.observe([torch.tensor([1.0, 3.0])], forward, now) == pytest.approx(0.5)
    assert guard.observe([torch.tensor([0.0])], [torch.tensor([2.0])], [torch.tensor([2.0])]) \
        is None  # nothing went stale: not counted
    mean = guard.window_mean()
    assert mean == pytest.approx(0.375) and not guard.trips(mean)
    guard.observe([torch.tensor([1.0, 4.0])], forward, now)  # ratio 0.75
    mean = guard.window_mean()
    assert mean == pytest.approx(0.75) and guard.trips(mean)
    assert guard.history == pytest.approx([0.375, 0.75]) and guard.window == []


def test_async_1f1b_staleness_is_the_stages_distance_from_the_end() -> None:
    p, n = 4, 10
    for k in range(p):
        actions = async_1f1b(p, k, n)
        assert [a.micro_batch for a in actions if a.kind == "U"] == list(range(n))
        assert staleness(actions) == {j: min(j, p - 1 - k) for j in range(n)}
    assert async_1f1b(4, 1, 4)[:4] == [Action("F", 0), Action("F", 1), Action("F", 2),
                                       Action("B", 0)]


def test_sync_1f1b_is_never_stale_and_two_bw_is_one_update_stale() -> None:
    for k in range(4):
        assert set(staleness(sync_1f1b(4, k, 3, 4)).values()) == {0}
        assert sum(a.kind == "U" for a in sync_1f1b(4, k, 3, 4)) == 3
        # 2BW over 4 micro-batches per update: a forward sees at most one update before its
        # backward (stage 0's warm-up spans 3 micro-batches)
        assert max(staleness(two_bw(4, k, 16, 4)).values()) == (1 if k < 3 else 0)
        assert sum(a.kind == "U" for a in two_bw(4, k, 16, 4)) == 4


def test_switching_to_flush_after_b_j_keeps_every_stages_past_actions() -> None:
    p, n, j = 4, 40, 15
    cut = drain_point(p, j)
    assert cut == 19
    for k in range(p):
        full, drained = async_1f1b(p, k, n), async_1f1b(p, k, cut)
        upto = full.index(Action("B", j)) + 1
        assert drained[:upto] == full[:upto]
        assert max(a.micro_batch for a in full[:upto] if a.kind == "F") == j + p - 1 - k


def test_config_refuses_a_prediction_rule_that_does_not_match_the_optimizer() -> None:
    with pytest.raises(ValueError, match="use optimizer 'adam'"):
        AsyncPipelineConfig(weight_prediction="adam", optimizer="sgd")
    with pytest.raises(ValueError, match="weight_prediction must be one of"):
        AsyncPipelineConfig(weight_prediction="specttrain")
    with pytest.raises(ValueError, match="momentum buffer"):
        AsyncPipelineConfig(weight_prediction="sgd", momentum=0.0)
    assert AsyncPipelineConfig(synchronous=True, num_microbatches=4).per_batch == 4
    assert AsyncPipelineConfig(weight_prediction="stash").per_batch == 1


def test_cost_model_prices_async_as_1f1b_without_the_flush_bubble() -> None:
    from meshmorph.cost.model import CostModel, steady_state
    from meshmorph.spec.catalog import catalog_model
    from meshmorph.spec.cluster import parse_cluster

    timeline = steady_state([1.0, 2.0, 1.0, 1.0], [2.0, 4.0, 2.0, 2.0], 8)
    assert timeline.makespan_s == 48.0  # 8 micro-batches x the slowest stage's f + b
    assert timeline.rank_busy_s == (24.0, 48.0, 24.0, 24.0)
    model = catalog_model("gpt-small")
    cost = CostModel(model, parse_cluster("h100:1x4"))
    base = Plan(model=model.name, seq_len=model.seq_len, global_batch=8, pp=4,
                micro_batch=1, num_microbatches=8).with_even_stages(model)
    sync = cost.estimate(base)
    asyn = cost.estimate(replace(base, schedule=Schedule.ASYNC, weight_prediction="sgd"))
    assert asyn.step_time_s < sync.step_time_s
    # the critical rank is the slowest stage: it idles in 1F1B's fill and drain; in async's
    # simulated steady state only for the transfers on its loop (about 0.1% of the step here)
    assert asyn.breakdown_s["pp_bubble"] < 0.01 * asyn.step_time_s
    assert asyn.breakdown_s["pp_bubble"] < 0.01 * sync.breakdown_s["pp_bubble"]


def test_plan_takes_weight_prediction_only_with_the_async_schedule() -> None:
    plan = Plan(model="gpt-small", seq_len=128, global_batch=4, pp=2, num_microbatches=4,
                schedule=Schedule("async"), weight_prediction="adam")
    assert Plan.from_json(plan.to_json()) == plan
    with pytest.raises(PlanError, match="applies only to schedule 'async'"):
        Plan(model="gpt-small", seq_len=128, global_batch=4, num_microbatches=4,
             weight_prediction="stash")
    with pytest.raises(PlanError, match="weight_prediction must be one of"):
        replace(plan, weight_prediction="momentum")
