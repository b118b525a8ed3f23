"""balance_batch's pair repartition (balancer.planning.batch.repartition) and the "auto" count search from a start."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import balancer
from balancer.planning.batch.balance import fewest_fitting
from balancer.planning.batch.large import pack_replica
from balancer.planning.batch.pack import pack_complete
from balancer.planning.batch.repartition import repartition_pairs

COST = balancer.CostModel(attn_coef=2 / 53000, linear_coef=1.0)


def _sft_slice(rng: np.random.Generator, n: int) -> np.ndarray:
    return np.minimum(rng.lognormal(np.log(2000), 0.6, n), 4096).astype(np.int64) + 1


def _replica_times(bins: np.ndarray, cost: np.ndarray, topo: balancer.Topology) -> np.ndarray:
    return np.bincount(bins // topo.micro_batches, weights=cost, minlength=topo.dp)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(8, 60), dp=st.sampled_from([2, 3, 4]), m=st.sampled_from([1, 2, 4]))
def test_repartition_is_never_slower_and_keeps_every_rule(seed, n, dp, m):
    rng = np.random.default_rng(seed)
    tokens = _sft_slice(rng, n)
    cost = COST.cost(tokens)
    topo = balancer.Topology(dp=dp, micro_batches=m, max_tokens=8192)
    bins = pack_complete(cost, tokens, topo)
    if bins is None:
        return
    before = bins.copy()
    after = repartition_pairs(bins, cost, tokens, topo, pack_replica)
    assert np.array_equal(bins, before)  # the input is left as it is
    assert _replica_times(after, cost, topo).max() <= _replica_times(before, cost, topo).max() * (1 + 1e-12)
    nb = topo.bins_per_step
    assert after.min() >= 0 and after.max() < nb
    assert np.bincount(after, minlength=nb).min() >= 1  # every micro-batch non-empty
    assert np.bincount(after, weights=tokens, minlength=nb).max() <= topo.micro_batch_tokens


def test_slices_of_a_few_dozen_documents_land_within_a_hundredth_of_a_percent_on_average():
    """36-document slices on dp4 x M4 (the peers' fixed batches of SFT data): the single move/swap search alone
    stopped ~0.08% above the bound on average; the pair repartition brings it near the bound."""
    rng = np.random.default_rng(3)
    topo = balancer.Topology(dp=4, micro_batches=4, max_tokens=8192)
    gaps = []
    for _ in range(40):
        lengths = _sft_slice(rng, 36)
        plan = balancer.balance_batch(lengths, topo, COST)
        plan.validate()
        c = COST.cost(lengths)
        bound = max(c.sum() / topo.dp, c.max())
        gaps.append(plan.metrics()["step_time_total"] / bound - 1)
    assert np.mean(gaps) < 1e-4, np.mean(gaps)


def test_repartition_with_rank_speeds_aims_at_equal_times():
    rng = np.random.default_rng(5)
    tokens = _sft_slice(rng, 40)
    cost = COST.cost(tokens)
    topo = balancer.Topology(dp=4, micro_batches=2, max_tokens=16384, rank_speeds=(1.5, 1.0, 1.0, 1.0))
    bins = pack_complete(cost, tokens, topo)
    after = repartition_pairs(bins, cost, tokens, topo, pack_replica)
    speeds = np.array(topo.rank_speeds)
    t_before = (_replica_times(bins, cost, topo) / speeds).max()
    t_after = (_replica_times(after, cost, topo) / speeds).max()
    assert t_after <= t_before
    assert t_after <= cost.sum() / speeds.sum() * 1.01  # within 1% of the speed-weighted bound


@settings(max_examples=200, deadline=None)
@given(
    first=st.integers(1, 50),
    span=st.integers(0, 200),
    answer=st.integers(1, 300),
    step=st.sampled_from([1, 2, 3]),
    start=st.one_of(st.none(), st.integers(0, 400)),
)
def test_fewest_fitting_from_any_start_is_the_linear_scans_answer(first, span, answer, step, start):
    first = first * step
    last = first + span // step * step
    tried = []

    def attempt_at(m):
        tried.append(m)
        return ("fits", m) if m >= answer else None

    start = None if start is None else start // step * step
    m, attempt = fewest_fitting(first, last, step, attempt_at, start)
    linear = next((k for k in range(first, last + 1, step) if k >= answer), last + step)
    assert m == linear
    assert (attempt is None) == (linear > last)
    assert all(first <= k <= last and k % step == 0 for k in tried)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(8, 400), dp=st.sampled_from([2, 3, 8]), cap=st.floats(0.3, 1.2))
def test_equal_counts_on_uneven_ranks_reuses_the_uncapped_assignment_only_where_the_cap_never_bound(seed, n, dp, cap):
    from balancer.planning.batch.large import balance_swaps, lpt_timed
    from balancer.planning.batch.pack import _timed_equal_counts

    rng = np.random.default_rng(seed)
    tokens = _sft_slice(rng, n)
    cost = COST.cost(tokens)
    speeds = np.concatenate([[1.2], np.ones(dp - 1)])
    rank_cap = int(cap * tokens.sum() * 1.2 / speeds.sum())
    for room in (rank_cap, rank_cap * 2):  # the second call finds the first one's uncapped assignment
        low, extra = divmod(n, dp)
        most = np.full(dp, low, dtype=np.int64)
        most[np.argsort(-speeds, kind="stable")[:extra]] += 1
        direct = lpt_timed(cost, tokens, speeds, room, most=most)
        if direct is not None:
            balance_swaps(direct, cost, tokens, room, speeds)
        got = _timed_equal_counts(cost, tokens, speeds, room)
        assert (got is None) == (direct is None)
        if got is not None:
            assert np.array_equal(got, direct)


def test_a_token_full_replica_of_short_documents_takes_a_long_one_for_short_ones(monkeypatch):
    # heavy slices: one replica full to the last token of short documents (cheap per token), the slowest holding
    # long ones. Splitting a few dozen of the pair's cheapest items (all short) moves no work; trading a long
    # document for short ones of as many tokens does. Old: the slowest stayed 22% over the bound; now within 2%.
    import balancer.planning.batch.repartition as repartition

    cost_model = balancer.CostModel(attn_coef=1 / 500, linear_coef=1.0)
    tokens = np.array([800, 700, 300, 150] + [10] * 200, dtype=np.int64)
    cost = cost_model.cost(tokens)
    topo = balancer.Topology(dp=2, micro_batches=2, max_tokens=1000)
    bins = np.array([0, 1, 1, 0] + [2] * 100 + [3] * 100, dtype=np.int64)  # replica 1 holds 2000 of 2000 tokens
    bound, slowest = cost.sum() / 2, _replica_times(bins, cost, topo).max()
    assert slowest > bound * 1.2
    after = repartition_pairs(bins, cost, tokens, topo, pack_replica)
    assert _replica_times(after, cost, topo).max() < bound * 1.02
    nb = topo.bins_per_step
    assert np.bincount(after, weights=tokens, minlength=nb).max() <= topo.micro_batch_tokens
    assert np.bincount(after, minlength=nb).min() >= 1
    monkeypatch.setattr(repartition, "_trade", lambda *a: False)  # the pair splits alone
    assert _replica_times(repartition_pairs(bins, cost, tokens, topo, pack_replica), cost, topo).max() == slowest
