"""Attention pair counts: how many (query, key) pairs attention computes for a document (`attention_pairs`) or
between two position ranges of one (`block_pairs`), under the causal / bidirectional and sliding-window masks.
The formulas under `CostModel` and the layout-aware terms of balancer.planning.cost.microbatch."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _clamped_prefix(x: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """`sum_{y <= x} clamp(y, 0, cap)` over integers y (0 for x <= 0), vectorised."""
    x = np.maximum(x, 0.0)
    inside = np.minimum(x, cap)
    return inside * (inside + 1.0) / 2.0 + np.maximum(x - cap, 0.0) * cap


def _causal_block_pairs(q_lo, q_hi, k_lo, k_hi, window) -> np.ndarray:
    """Pairs (i, j) with i in [q_lo, q_hi), j in [k_lo, k_hi) and 0 <= i - j < window (window inf: j <= i)."""

    def below(a, b):  # pairs with 0 <= i < a, 0 <= j < b, 0 <= i - j < window
        # sum_{i<a} (#{j <= i, j < b} - #{j <= i - window, j < b}) = sum_i clamp(i+1, 0, b) - clamp(i+1-window, 0, b)
        near = _clamped_prefix(a, b)
        if np.isinf(window).all():
            return near
        far = _clamped_prefix(a - window, b)
        return near - np.where(np.isinf(window), 0.0, far)

    return below(q_hi, k_hi) - below(q_lo, k_hi) - below(q_hi, k_lo) + below(q_lo, k_lo)


def block_pairs(q_lo, q_hi, k_lo, k_hi, causal: bool = True, window: int | None = None) -> np.ndarray:
    """(query, key) pairs attention computes between query positions [q_lo, q_hi) and key positions [k_lo, k_hi)
    of one document (float64, vectorised over the arguments).

    Causal: pairs with `0 <= i - j < window`; non-causal: `|i - j| < window`; `window=None` is unlimited.
    """
    args = [np.asarray(a, dtype=np.float64) for a in (q_lo, q_hi, k_lo, k_hi)]
    q_lo, q_hi, k_lo, k_hi = np.broadcast_arrays(*args)
    w = np.full(q_lo.shape, np.inf if window is None else float(window))
    ahead = _causal_block_pairs(q_lo, q_hi, k_lo, k_hi, w)
    if causal:
        return ahead
    behind = _causal_block_pairs(k_lo, k_hi, q_lo, q_hi, w)  # j - i >= 0 within the window
    diagonal = np.maximum(np.minimum(q_hi, k_hi) - np.maximum(q_lo, k_lo), 0.0)
    return ahead + behind - diagonal


def attention_pairs(lengths: np.ndarray | Sequence[int], causal: bool = True, window: int | None = None) -> np.ndarray:
    """Number of (query, key) pairs attention computes for documents of the given lengths (float64).

    Full attention: `d*(d+1)/2` causal, `d*d` otherwise. With a sliding window of `w` keys per query (query i sees
    keys i-w+1..i, the Hugging Face / flash-attn convention): `d*(d+1)/2` for `d <= w`, else `w*(w+1)/2 + (d-w)*w`
    (= `d*w - w*(w-1)/2`); non-causal windowed (`|i-j| < w`): twice that minus `d`.
    """
    d = np.asarray(lengths, dtype=np.float64)
    if window is None:
        return d * (d + 1.0) / 2.0 if causal else d * d
    w = float(window)
    one_way = np.where(d <= w, d * (d + 1.0) / 2.0, w * (w + 1.0) / 2.0 + (d - w) * w)
    return one_way if causal else 2.0 * one_way - d
