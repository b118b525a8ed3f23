"""Hostile inputs to `balance_batch` on uneven ranks (one rank 100x faster or slower, dp 1 to 64, a handful of
documents to thousands, equal counts). Old: with `equal_counts=True` and one rank 5x (or more) faster on dp=64, a
batch that even ranks plan at micro_batches=5 was refused at every count ("micro_batches='auto' found no count that
fits", and at a fixed count "does not fit"): finish-time LPT with the counts held equal filled the fast rank's token
room with the largest documents to the last token, which no M micro-batches split. New: where the speed-weighted
assignment does not split, the ranks' even assignment is taken where it does (the plan still records the speeds)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import balancer

COST = balancer.CostModel(attn_coef=1 / 2000, linear_coef=1.0)


def _plan(lengths, dp, speeds, micro_batches, equal_counts):
    topo = balancer.Topology(dp=dp, max_tokens=16384, rank_speeds=speeds)
    return balancer.balance_batch(lengths, topo, COST, micro_batches=micro_batches, equal_counts=equal_counts)


def _check(plan, lengths, dp, equal_counts) -> None:
    plan.validate()  # every document exactly once, every micro-batch within its tokens, none empty
    assert plan.num_docs == len(lengths)
    if equal_counts:
        counts = np.diff(plan.mb_ptr).reshape(dp, -1).sum(axis=1)
        assert counts.max() - counts.min() <= 1


@pytest.mark.parametrize("n", [1000, 3000, 5000])
@pytest.mark.parametrize("fast", [5.0, 100.0])
def test_equal_counts_with_a_fast_rank_on_dp64_plans_where_even_ranks_do(n, fast):
    lengths = np.random.default_rng(n).integers(1, 9000, n)
    speeds = (fast,) + (1.0,) * 63
    even = _plan(lengths, 64, None, "auto", True)
    plan = _plan(lengths, 64, speeds, "auto", True)  # old: ValueError "found no count that fits"
    _check(plan, lengths, 64, True)
    assert plan.topology.rank_speeds == speeds
    assert plan.topology.micro_batches <= even.topology.micro_batches
    fixed = _plan(lengths, 64, speeds, even.topology.micro_batches, True)  # old: ValueError "does not fit"
    _check(fixed, lengths, 64, True)


@st.composite
def batches(draw):
    dp = draw(st.sampled_from([1, 2, 3, 8, 64]))
    n = draw(st.integers(dp, 6 * dp + 40))
    top = draw(st.sampled_from([200, 8000, 16384]))
    lengths = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).integers(1, top + 1, n)
    extreme = draw(st.sampled_from([100.0, 0.01, 5.0, 0.2]))
    speeds = tuple(extreme if r == draw(st.integers(0, dp - 1)) else 1.0 for r in range(dp))
    return lengths, dp, speeds, draw(st.booleans())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=batches())
def test_uneven_ranks_plan_every_count_even_ranks_plan(case):
    lengths, dp, speeds, equal_counts = case
    try:
        even = _plan(lengths, dp, None, "auto", equal_counts)
    except ValueError as e:  # too few documents for the ranks: uneven ranks refuse it the same way
        with pytest.raises(ValueError):
            _plan(lengths, dp, speeds, "auto", equal_counts)
        assert "micro_batches" in str(e) or "documents" in str(e)
        return
    m = even.topology.micro_batches
    _check(_plan(lengths, dp, speeds, m, equal_counts), lengths, dp, equal_counts)
    auto = _plan(lengths, dp, speeds, "auto", equal_counts)
    _check(auto, lengths, dp, equal_counts)


def _count_bound(lengths, speeds, m) -> float:
    """A lower bound on the imbalance of one step on ranks of `speeds` with `m` micro-batches each: the slowest rank
    holds at least the `m` cheapest documents (no micro-batch is empty), the others at most all the rest."""
    c = np.sort(COST.cost(lengths))
    slow = int(np.argmin(speeds))
    least = c[:m].sum() / speeds[slow]
    rest = (c.sum() - c[:m].sum()) / (sum(speeds) - speeds[slow])
    return max(least, rest) / (c.sum() / sum(speeds))


def test_a_100x_slow_rank_on_the_large_path_gets_near_the_count_bound():
    # old: the large path (>= LARGE_UNITS documents) found no speed-weighted deal (20 virtual bins for the slowest
    # rank's share make more bins than units) and dealt evenly: the 100x slower rank held a quarter of the documents,
    # typical ones, and the pair search by time traded few of them down: imbalance 41.25 against a bound of 1.32.
    # New: fewer bins where the shares need more than the units, and a replica short of its micro-batches' units
    # takes the cheapest ones first
    lengths = np.random.default_rng(3).integers(1, 9000, 5000)
    speeds = (0.01, 1.0, 1.0, 1.0)
    plan = _plan(lengths, 4, speeds, 500, False)
    _check(plan, lengths, 4, False)
    assert plan.metrics()["imbalance"] < 1.01 * _count_bound(lengths, speeds, 500)


def test_a_100x_slow_rank_on_the_small_path_reaches_the_count_bound():
    lengths = np.random.default_rng(3).integers(1, 9000, 1500)
    speeds = (0.01, 1.0, 1.0, 1.0)
    for m in (200, 300):
        plan = _plan(lengths, 4, speeds, m, False)
        _check(plan, lengths, 4, False)
        assert plan.metrics()["imbalance"] < 1.01 * _count_bound(lengths, speeds, m)
