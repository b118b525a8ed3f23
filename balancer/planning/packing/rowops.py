"""Array helpers of the planner's hot loops: reductions over a short last axis ([steps, replicas, micro-batches]
arrays) as chains of whole-array calls (NumPy reduces many short rows about ten times slower than it adds a few long
columns), and small matrix products that stay off the threaded BLAS."""

from __future__ import annotations

import numpy as np

SHORT_AXIS = 8  # a last axis up to this long is reduced by a chain of calls
SINGLE_THREAD_PRODUCT = 1 << 18  # multiply-adds per matrix product block (OpenBLAS threads larger ones)


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


def product(left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """`left @ right` for [rows, k] x [k, columns], in row blocks small enough that OpenBLAS runs each on the calling
    thread (it threads a product above 4 * 65536 multiply-adds). A threaded call on a busy machine (every rank of a
    node plans at once) waits for cores and leaves its workers spinning: measured 100x the CPU of the product."""
    rows = max(1, SINGLE_THREAD_PRODUCT // max(1, left.shape[1] * right.shape[1]))
    if len(left) <= rows:
        return left @ right
    out = np.empty((len(left), right.shape[1]), dtype=np.result_type(left, right))
    for first in range(0, len(left), rows):
        np.matmul(left[first : first + rows], right, out=out[first : first + rows])
    return out
