"""Argument types shared by the subcommands: a bad number is refused by argparse with a message
that names what was expected."""

from __future__ import annotations

import argparse
from collections.abc import Callable


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


def bounded_int(limit: int, unit: str) -> Callable[[str], int]:
    """A positive whole number no larger than ``limit`` (a larger one is a typo)."""
    def parse(text: str) -> int:
        value = positive_int(text)
        if value > limit:
            raise argparse.ArgumentTypeError(
                f"{value} is above the limit of {limit:,} {unit} (2**{limit.bit_length() - 1}); "
                "pass a realistic value")
        return value
    return parse
