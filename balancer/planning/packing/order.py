"""Largest first, fast: the order `np.argsort(-cost, kind="stable")` (cost descending, ties in given order) found by
an unstable integer sort on the units' token counts where the cost grows with the tokens.

A unit's cost is a function of its tokens that never falls as they grow (the cost model's terms are non-negative),
so sorting by tokens, longest first, with the position as the last key, is the stable cost order. Integer keys
that are unique sort without a stable sort (NumPy's stable sort of floats is a merge sort, several times slower);
the result is checked against the costs (non-increasing, equal costs in given order) and the stable float sort is
used whenever the check fails, so the order is always exactly the stable one.
"""

from __future__ import annotations

import numpy as np

SMALL = 64  # fewer units than this: the float sort directly (the check costs more than it saves)


def largest_first(cost: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """`np.argsort(-cost, kind="stable")` for units of `cost` and `tokens` (1-D, same length)."""
    n = len(cost)
    if n >= SMALL and _small_tokens(tokens, n):
        order = np.argsort((int(tokens.max()) - tokens.astype(np.int64)) * n + np.arange(n))
        if _descending(cost[order], order):
            return order
    return np.argsort(-cost, kind="stable")


def _small_tokens(tokens: np.ndarray, n: int) -> bool:
    """Token keys times `n` stay far inside int64 (and no negative counts)."""
    return bool(len(tokens)) and int(tokens.min()) >= 0 and int(tokens.max()) < (1 << 40) // max(n, 1)


def _descending(cost: np.ndarray, order: np.ndarray) -> bool:
    """`cost` (in `order`) never rises, and equal neighbours keep their given order."""
    step = np.diff(cost)
    return bool(np.all(step <= 0) and np.all(np.diff(order)[step == 0] > 0))
