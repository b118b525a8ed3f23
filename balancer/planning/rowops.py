"""Reductions over a short last axis ([steps, replicas, micro-batches] arrays), as chains of whole-array calls:
NumPy reduces many short rows about ten times slower than it adds a few long columns."""

from __future__ import annotations

import numpy as np

SHORT_AXIS = 8  # a last axis up to this long is reduced by a chain of calls


def last_axis(ufunc: np.ufunc, values: np.ndarray) -> np.ndarray:
    """`ufunc.reduce(values, axis=-1)` (np.add, np.minimum, np.maximum, ...)."""
    if values.shape[-1] > SHORT_AXIS or values.shape[-1] == 0:
        return ufunc.reduce(values, axis=-1)
    out = values[..., 0].copy()
    for j in range(1, values.shape[-1]):
        ufunc(out, values[..., j], out=out)
    return out


def argmin_last(values: np.ndarray) -> np.ndarray:
    """`np.argmin(values, axis=-1)`: the first minimum of every row."""
    if values.shape[-1] > SHORT_AXIS:
        return np.argmin(values, axis=-1)
    best = values[..., 0].copy()
    index = np.zeros(best.shape, dtype=np.int64)
    for j in range(1, values.shape[-1]):
        lower = values[..., j] < best
        np.copyto(best, values[..., j], where=lower)
        index[lower] = j
    return index
