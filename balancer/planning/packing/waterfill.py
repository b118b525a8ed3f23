"""Water-filling a step's light work onto its micro-batches: the deficits that bring every replica to one common
1F1B time.

A replica whose micro-batches cost b_1..b_M (largest h, sum B, current time c = (P-1)*h + B) takes light work up
to a level l on every micro-batch below l; its time is (P-1)*max(h, l) + sum_j max(b_j, l) (divided by its speed
with uneven ranks: at a common time T a replica of speed s runs T * s of it). The room it offers at time T is
piecewise linear in its own work-time t = T * s:

    0 for t < c,   t - c for c <= t < (P-1+M) * h,   M * t / (P-1+M) - B above,

so the common time T* at which the rooms add up to the work is found exactly from the 2 * dp breakpoints. The
deficits are those of a bisection on T (60 halvings at most, to 1e-9 of T): its steps are replayed against T*
(a halving's test "room(mid) < work" is "mid < T*"), and only a midpoint within rounding of T* is tested on the
rooms themselves, so the result is the bisection's to the bit at a few NumPy calls instead of ~40 rounds of them.
"""

from __future__ import annotations

import numpy as np

from balancer.planning.metrics import one_f_one_b

HALVINGS = 60  # the bisection's most halvings ...
CONVERGED = 1e-9  # ... until the bracket is this share of its upper end
NEAR = 1e-10  # a midpoint this close to T* (relative) is tested on the rooms, not against T*


def water_fill(loads: np.ndarray, work: float, pp: int, speeds: np.ndarray | None = None) -> np.ndarray:
    """Deficits [dp, M] so that adding `work` in those amounts leaves every replica at the same 1F1B time (module
    docstring); zeros for `work` <= 0."""
    dp, m = loads.shape
    if work <= 0:
        return np.zeros_like(loads)
    ascending = np.sort(loads, axis=1)
    largest = ascending[:, -1]
    rank = np.arange(1, m + 1, dtype=np.float64)
    above = ascending.sum(axis=1, keepdims=True) - np.cumsum(ascending, axis=1)  # sum of the bins above the k-th
    curve = one_f_one_b(largest[:, None], rank * ascending, pp, above)  # time when level = k-th smallest
    rows = np.arange(dp)

    def levels(time: float) -> np.ndarray:
        own = np.full(dp, float(time)) if speeds is None else time * speeds  # each replica's own work-time
        below = (curve <= own[:, None]).sum(axis=1)
        idx = np.maximum(below - 1, 0)
        level = (own - (pp - 1) * largest - above[rows, idx]) / np.maximum(below, 1)
        level = np.where(below == m, own / (pp - 1 + m), level)
        return np.where(below == 0, -np.inf, level)

    def short(time: float) -> bool:  # the bisection's test: the rooms at `time` hold less than the work
        return float(np.maximum(levels(time)[:, None] - loads, 0.0).sum()) < work

    if speeds is None:
        lo, hi = float(curve[:, 0].min()), float(curve[:, -1].max() + work * (pp - 1 + m) / m + work)
    else:
        lo = float((curve[:, 0] / speeds).min())
        slowest = speeds.min()  # the same sum as above, in the same order, when every speed is 1
        hi = float((curve[:, -1] / speeds).max() + work * (pp - 1 + m) / m / slowest + work / slowest)
    exact = common_time(curve[:, 0], curve[:, -1], ascending.sum(axis=1), work, m / (pp - 1 + m), speeds)
    known = bool(np.isfinite(exact))
    for _ in range(HALVINGS):
        mid = 0.5 * (lo + hi)
        if known and abs(mid - exact) > NEAR * abs(exact):
            below = mid < exact
        else:
            below = short(mid)
        if below:
            lo = mid
        else:
            hi = mid
        if hi - lo <= CONVERGED * hi:
            break
    return np.maximum(levels(hi)[:, None] - loads, 0.0)


def common_time(
    now: np.ndarray, full: np.ndarray, total: np.ndarray, work: float, share: float, speeds: np.ndarray | None = None
) -> float:
    """T* at which the replicas' rooms (module docstring) add up to `work` > 0: `now` their current times c, `full`
    the times (P-1+M) * h at which the level reaches their largest micro-batch, `total` their summed cost B (all
    work-times, [dp]), `share` = M / (P-1+M); nan when no replica takes work there."""
    s = np.ones(len(now)) if speeds is None else np.asarray(speeds, dtype=np.float64)
    # breakpoints on the common time: a replica starts taking work at now / s, its slope changes at full / s
    points = np.sort(np.concatenate([now / s, full / s]))
    k = int(np.searchsorted(_rooms(points, now, full, total, share, s), work))  # first breakpoint reaching it
    # T* lies in [points[k-1], points[k]) (k >= 1: the rooms are 0 at the first breakpoint), or past the last one;
    # each replica's piece is read strictly inside that segment, where no breakpoint lies
    inside = 0.5 * (points[k - 1] + points[k]) if k < len(points) else 2.0 * points[-1] + 1.0
    own = inside * s
    rising, flat = own >= now, (own >= now) & (own < full)
    slope = float(np.where(flat, s, np.where(rising, share * s, 0.0)).sum())
    offset = float(np.where(flat, -now, np.where(rising, -total, 0.0)).sum())
    return (work - offset) / slope if slope > 0 else float("nan")


def _rooms(
    times: np.ndarray, now: np.ndarray, full: np.ndarray, total: np.ndarray, share: float, s: np.ndarray
) -> np.ndarray:
    """The replicas' summed room at each common time of `times` (module docstring)."""
    own = times[None, :] * s[:, None]  # [dp, times]
    room = np.where(own < full[:, None], own - now[:, None], share * own - total[:, None])
    return np.where(own < now[:, None], 0.0, room).sum(axis=0)
