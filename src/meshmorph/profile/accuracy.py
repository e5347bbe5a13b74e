"""Accuracy of predictions against measurements: MAPE and Kendall's tau (``validate``)."""

from __future__ import annotations

from collections.abc import Sequence


def mape(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Mean absolute percentage error, in percent: 100/n * sum |p - m| / m."""
    if len(predicted) != len(measured) or not measured:
        raise ValueError(f"MAPE needs as many predictions as measurements (>= 1); got "
                         f"{len(predicted)} and {len(measured)}")
    if min(measured) <= 0:
        raise ValueError("MAPE needs positive measurements; a step took no time?")
    return 100.0 * sum(abs(p - m) / m for p, m in zip(predicted, measured, strict=True)) / len(measured)


def kendall_tau(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Kendall's tau-b of the two orderings (scipy.stats.kendalltau): 1 = same order of plans.
    Needs two plans at least; NaN where either side is constant."""
    if len(predicted) < 2:
        raise ValueError("Kendall tau needs two plans at least; run validate with --plans 2 or more")
    from scipy import stats  # scipy takes a second to import: only where tau is computed

    return float(stats.kendalltau(predicted, measured).statistic)
