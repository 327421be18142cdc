"""argparse value types shared by the scripts (``scripts/bench_*.py``): each refuses a value
outside its range with ``argparse.ArgumentTypeError``, which argparse turns into a one-line
error naming the option (exit 2)."""

from __future__ import annotations

import argparse
import math


def positive_int(x: str) -> int:
    """A decimal integer >= 1 (no sign, no exponent)."""
    if not x.isascii() or not x.isdigit() or int(x) < 1:
        raise argparse.ArgumentTypeError(f"{x!r} is not a positive integer")
    return int(x)


def _float(x: str) -> float:
    try:
        return float(x)
    except ValueError:
        return float("nan")


def positive_float(x: str) -> float:
    """A finite number > 0."""
    v = _float(x)
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"{x!r} is not a positive, finite number")
    return v


def unit_float(x: str) -> float:
    """A number in [0, 1]."""
    v = _float(x)
    if not 0 <= v <= 1:          # also refuses nan
        raise argparse.ArgumentTypeError(f"{x!r} is not a number in [0, 1]")
    return v
