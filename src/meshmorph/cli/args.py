"""Argument types shared by the subcommands: a bad number is refused by argparse with a message
that names what was expected."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def _whole_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None


def positive_int(text: str) -> int:
    """A whole number >= 1."""
    value = _whole_number(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """A whole number >= 0 (a seed, a count that may be zero)."""
    value = _whole_number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


MAX_RUNS = 2**12
"""The most simulated runs one command takes (a thousand already pin the percentiles down)."""
MAX_TOKENS = 1e15
"""The most tokens a simulated run may train: 25 times the largest published training run
(about 4e13 tokens); more is a typo, and would keep the simulation going for hours."""


def bounded(parse: Callable[[str], Any], limit: float, what: str) -> Callable[[str], Any]:
    """``parse``, refusing a value above ``limit`` (a larger one is a typo); ``what`` names it."""
    def check(text: str) -> Any:
        value = parse(text)
        if value > limit:
            raise argparse.ArgumentTypeError(f"{text} is above the limit of {what}; pass a "
                                             "realistic value")
        return value
    return check


def bounded_int(limit: int, unit: str) -> Callable[[str], int]:
    """A positive whole number no larger than ``limit``."""
    return bounded(positive_int, limit, f"{limit:,} {unit} (2**{limit.bit_length() - 1})")


token_count = bounded(positive_float, MAX_TOKENS, f"{MAX_TOKENS:.0e} tokens (25 times the largest "
                      "published training run)")
"""A finite number of tokens > 0, no more than ``MAX_TOKENS``."""
