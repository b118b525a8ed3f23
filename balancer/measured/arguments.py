"""Checks of what `BalanceMonitor.record` is given: a time is a real number of seconds, never a string or a bool
(`float("0.5")` and `float(True)` would read as times), and a position is an integer."""

from __future__ import annotations

import math
import numbers
from typing import Optional


def checked_seconds(seconds) -> float:
    """`seconds` as a float: a finite real number >= 0 that is not a bool; a ValueError naming `seconds` otherwise."""
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real):
        raise ValueError(
            f"record: seconds must be a number of seconds (int or float), got {type(seconds).__name__} {seconds!r}"
        )
    value = float(seconds)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"record: seconds must be a finite number >= 0, got {seconds!r}")
    return value


def checked_position(name: str, value) -> Optional[int]:
    """`value` (None, or an integer >= 0 that is not a bool) as an int; a ValueError naming `name` otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"record: {name} must be an integer >= 0, got {type(value).__name__} {value!r}")
    return int(value)
