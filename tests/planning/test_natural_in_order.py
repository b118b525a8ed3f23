"""`natural_steps` with the lengths already in shuffled order (`in_order`, what the planner has at hand) gives the
very steps it computes from the lengths, and a plan's natural steps are the shuffled order cut every step's
tokens, with documents cut into units as without."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import balancer
from balancer.planning.metrics import natural_steps


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 400), tps=st.integers(1, 5000), seed=st.integers(0, 2**31))
def test_in_order_gives_the_same_steps(n, tps, seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 3000, n)
    order = rng.permutation(n)
    expected = np.empty(n, dtype=np.int64)
    expected[order] = (np.cumsum(lengths[order]) - lengths[order]) // tps
    np.testing.assert_array_equal(natural_steps(order, lengths, tps), expected)
    np.testing.assert_array_equal(natural_steps(order, lengths, tps, lengths[order]), expected)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 1000), overflow=st.sampled_from(["error", "split", "truncate"]))
def test_plan_natural_steps(seed, overflow):
    rng = np.random.default_rng(seed)
    topo = balancer.Topology(dp=2, micro_batches=2, max_tokens=1024)
    lengths = rng.integers(1, 1024 if overflow == "error" else 3000, 300)
    plan = balancer.plan(lengths, topo, balancer.CostModel(attn_coef=1e-4, linear_coef=1.0), seed=seed,
                         overflow=overflow)  # fmt: skip
    order = np.random.default_rng(seed).permutation(len(lengths))
    placed = np.bincount(plan.doc, weights=plan.end - plan.start, minlength=len(lengths)).astype(np.int64)
    steps = plan.natural_step
    assert steps is not None and steps.min() == 0
    in_order = steps[order]
    assert np.all(np.diff(in_order) >= 0)  # nondecreasing along the shuffled order
    # the step size the plan cut by: every document starts in the step its tokens before it reach
    before = np.cumsum(placed[order]) - placed[order]
    later = in_order > 0
    tps = int((before[later] // in_order[later]).min()) if later.any() else int(before.max()) + 1  # the largest fit
    np.testing.assert_array_equal(natural_steps(order, placed, tps), steps)


def test_natural_steps_are_computed_on_first_use_and_kept():
    """The planner hands the plan how to compute its natural steps: the same array on every read (computed once),
    and a plan whose natural steps were set to None reports no delay."""
    import balancer.planning.metrics as metrics

    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 1024, 500)
    topo = balancer.Topology(dp=2, micro_batches=2, max_tokens=1024)
    calls = []
    real = metrics.natural_steps
    try:
        import balancer.planning.planner as planner

        planner.natural_steps = lambda *a: calls.append(1) or real(*a)
        plan = balancer.plan(lengths, topo, balancer.CostModel(attn_coef=1e-4, linear_coef=1.0), seed=3)
        assert calls == []  # not computed while planning
        first = plan.natural_step
        assert first is plan.natural_step and calls == [1]  # computed once, then kept
    finally:
        planner.natural_steps = real
    order = np.random.default_rng(3).permutation(len(lengths))
    assert first is not None and np.all(np.diff(first[order]) >= 0) and first.dtype == np.int64
    assert np.isfinite(plan.metrics()["mean_delay_steps"])
    plan.natural_step = None
    assert plan.natural_step is None and np.isnan(plan.metrics()["mean_delay_steps"])
