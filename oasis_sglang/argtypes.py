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


def transfer_budget(x: str):
    """``transfer_budget`` as a flag value: ``auto``, ``null`` (no step budget), a link fraction
    written with a decimal point (``0.5``) or an integer of bytes per step, as the config key
    (``config.OasisConfig``; the range is checked there). ``auto`` / ``null`` / ``none`` in any case.

    Raises:
        argparse.ArgumentTypeError: none of these forms (e.g. ``1e9``, ``half``, ``-1``)."""
    t = x.strip()
    if t.lower() == "auto":
        return "auto"
    if t.lower() in ("null", "none"):
        return None
    if t.isascii() and t.isdigit():
        return int(t)
    if "." in t:
        v = _float(t)
        if math.isfinite(v):
            return v
    raise argparse.ArgumentTypeError(f"{x!r}: want auto, null, a link fraction such as 0.5, or an integer of bytes "
                                     f"per step")
