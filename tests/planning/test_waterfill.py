"""The water-filling deficits: the exact common time replays the bisection it replaced to the bit, and the deficits
bring every replica that takes work to one 1F1B time."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer.planning.metrics import one_f_one_b
from balancer.planning.packing.waterfill import water_fill


def bisection(loads: np.ndarray, work: float, pp: int, speeds: np.ndarray | None = None) -> np.ndarray:
    """The former implementation: bisection on the common time, the rooms summed at every midpoint."""
    dp, m = loads.shape
    if work <= 0:
        return np.zeros_like(loads)
    ascending = np.sort(loads, axis=1)
    largest = ascending[:, -1]
    rank = np.arange(1, m + 1, dtype=np.float64)
    above = ascending.sum(axis=1, keepdims=True) - np.cumsum(ascending, axis=1)
    curve = one_f_one_b(largest[:, None], rank * ascending, pp, above)
    rows = np.arange(dp)

    def levels(time: float) -> np.ndarray:
        own = np.full(dp, float(time)) if speeds is None else time * speeds
        below = (curve <= own[:, None]).sum(axis=1)
        idx = np.maximum(below - 1, 0)
        level = (own - (pp - 1) * largest - above[rows, idx]) / np.maximum(below, 1)
        level = np.where(below == m, own / (pp - 1 + m), level)
        return np.where(below == 0, -np.inf, level)

    if speeds is None:
        lo, hi = float(curve[:, 0].min()), float(curve[:, -1].max() + work * (pp - 1 + m) / m + work)
    else:
        lo = float((curve[:, 0] / speeds).min())
        hi = float((curve[:, -1] / speeds).max() + work * (pp - 1 + m) / m / speeds.min() + work / speeds.min())
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if float(np.maximum(levels(mid)[:, None] - loads, 0.0).sum()) < work:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-9 * hi:
            break
    return np.maximum(levels(hi)[:, None] - loads, 0.0)


LOADS = st.sampled_from(["uniform", "small integers", "zeros", "heavy tail"])


@settings(max_examples=400, deadline=None)
@given(
    dp=st.integers(1, 8),
    m=st.integers(1, 8),
    pp=st.integers(1, 4),
    kind=LOADS,
    work=st.sampled_from([0.0, 1e-3, 0.5, 3.0, 40.0, 1e4]),
    speeds=st.sampled_from(["even", "random", "integers"]),
    seed=st.integers(0, 2**31),
)
def test_water_fill_equals_the_bisection(dp, m, pp, kind, work, speeds, seed):
    rng = np.random.default_rng(seed)
    loads = {
        "uniform": lambda: rng.random((dp, m)) * 10,
        "small integers": lambda: rng.integers(0, 4, (dp, m)).astype(np.float64),
        "zeros": lambda: np.zeros((dp, m)),
        "heavy tail": lambda: rng.lognormal(0, 2, (dp, m)) * (rng.random((dp, m)) < 0.6),
    }[kind]()
    s = {"even": None, "random": rng.random(dp) + 0.1, "integers": rng.integers(1, 4, dp).astype(np.float64)}[speeds]
    got = water_fill(loads, work, pp, s)
    assert np.array_equal(got, bisection(loads, work, pp, s))
    assert got.shape == loads.shape and np.all(got >= 0)
    if work > 0:  # the deficits hold the work (to the bisection's 1e-9) and level the replicas that take any
        assert abs(got.sum() - work) <= 1e-6 * max(work, 1.0) + 1e-6 * float(loads.sum())
        filled = loads + got
        times = one_f_one_b(filled.max(axis=1), filled.sum(axis=1), pp) / (1.0 if s is None else s)
        taking = got.sum(axis=1) > 1e-9 * work
        if taking.any():
            top = times[taking].max()
            assert np.all(times[taking] >= top * (1 - 1e-6))
            assert np.all(times[~taking] >= top * (1 - 1e-6))  # the others were already at or above it
