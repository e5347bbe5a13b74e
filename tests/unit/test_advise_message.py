"""``meshmorph advise`` with no option left names only the limits the user gave."""

from __future__ import annotations

from meshmorph.cli.advise import _nothing
from meshmorph.predict.advise import AdviceOptions


def test_without_limits_it_names_the_search_limits_not_deadline_or_budget() -> None:
    text = _nothing("llama2-7b", 1e20, AdviceOptions())
    assert "--deadline" not in text and "--budget" not in text
    assert "within 90 days on up to 8 instances" in text and "fewer tokens" in text


def test_with_limits_it_names_those_given() -> None:
    text = _nothing("llama2-7b", 1e10, AdviceOptions(deadline_h=0.01))
    assert "--deadline 0.01 h" in text and "raise --deadline" in text and "--budget" not in text
    both = _nothing("llama2-7b", 1e10, AdviceOptions(deadline_h=5, budget_usd=100))
    assert "--deadline 5 h and --budget $100" in both and "raise --deadline or --budget" in both
