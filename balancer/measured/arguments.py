"""Checks of what `BalanceMonitor.record` is given: a time is a real number of seconds, never a string or a bool
(`float("0.5")` and `float(True)` would read as times), and a position is an integer."""

from __future__ import annotations

import math
import numbers
from typing import Optional


def checked_seconds(seconds: object) -> float:
    """`seconds` as a float: a finite real number >= 0 that is not a bool; a ValueError naming `seconds` otherwise."""
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real):
        raise ValueError(
            f"record: seconds must be a number of seconds (int or float), got {type(seconds).__name__} {seconds!r}"
        )
    value = float(seconds)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"record: seconds must be a finite number >= 0, got {seconds!r}")
    return value


def checked_position(name: str, value: object) -> Optional[int]:
    """`value` (None, or an integer >= 0 that is not a bool) as an int; a ValueError naming `name` otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"record: {name} must be an integer >= 0, got {type(value).__name__} {value!r}")
    return int(value)


def check_monitor_options(timeout: object, min_samples: object, layout: object, cuda: object) -> None:
    """`BalanceMonitor`'s options that its own checks let through: a finite positive `timeout` (not a bool; an
    infinite one overflowed at the first gather), `min_samples` None or an integer >= 1, `layout` one of the CP
    layouts, `cuda` None or a bool. A ValueError naming the argument otherwise."""
    from attention.geometry import KINDS

    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not (0 < float(timeout) < math.inf):
        raise ValueError(f"timeout must be a finite positive number of seconds, got {timeout!r}")
    if min_samples is not None and (
        isinstance(min_samples, bool) or not isinstance(min_samples, numbers.Integral) or min_samples < 1
    ):
        raise ValueError(f"min_samples must be None or an integer >= 1, got {min_samples!r}")
    if layout not in KINDS:
        raise ValueError(f"layout must be one of {KINDS} (the collator's kind), got {layout!r}")
    if cuda is not None and not isinstance(cuda, bool):
        raise ValueError(f"cuda must be None, True or False, got {cuda!r}")
