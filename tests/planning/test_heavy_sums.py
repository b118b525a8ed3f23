"""Heavy units of a pp = 1 step placed on Python floats (`_place_heavy_sums`): the very placement of the
per-micro-batch table it replaced (least new replica time, ties the cheaper micro-batch, then the first), kept here
as the reference, on random steps with ties, token-full micro-batches and units that fit nowhere."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import balancer
from balancer.planning.packing.step import _Bins, _place_heavy_marginal, least_then_cheapest


def table(heavy: np.ndarray, cost: np.ndarray, tokens: np.ndarray, bins: _Bins, topology: balancer.Topology) -> None:
    """The former placement: every micro-batch's new replica time at once, one unit at a time."""
    dp, m, cap = topology.dp, topology.micro_batches, topology.micro_batch_tokens
    for i in heavy:
        if bins.unit_bin[i] >= 0:
            continue
        new_time = bins.cost.reshape(dp, m).sum(axis=1)[bins.replica_of_bin] + cost[i]
        new_time[bins.tokens + tokens[i] > cap] = np.inf
        j = least_then_cheapest(new_time, bins.cost)
        if j >= 0:
            bins.place(i, j, cost[i], tokens[i])


@settings(max_examples=150, deadline=None)
@given(
    dp=st.integers(1, 40),
    m=st.sampled_from([1, 2, 3, 4, 8, 9, 16]),
    n=st.integers(0, 300),
    grain=st.sampled_from([1, 7, 500]),
    preload=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_same_placement_as_the_table(dp, m, n, grain, preload, seed):
    rng = np.random.default_rng(seed)
    topology = balancer.Topology(dp=dp, micro_batches=m, max_tokens=4096)
    tokens = (rng.integers(1, 4096 // grain + 1, n) * grain).clip(1, 4096)  # coarse grains: many equal costs
    cost = tokens + 3.7e-5 * tokens.astype(np.float64) ** 2
    if grain == 500:
        cost = np.round(cost / 1000) * 1000  # exact ties between different replica sums
    heavy = np.argsort(-cost, kind="stable")
    ours, ref = _Bins.empty(n, topology), _Bins.empty(n, topology)
    if preload:  # micro-batches already holding work (and tokens), as after the pipelined pass
        loads, used = np.round(rng.uniform(0, 5000, dp * m), 1 if grain == 1 else -2), rng.integers(0, 4096, dp * m)
        for b in (ours, ref):
            b.cost[:], b.tokens[:] = loads, used
    _place_heavy_marginal(heavy, cost, tokens, ours, topology)
    table(heavy, cost, tokens, ref, topology)
    np.testing.assert_array_equal(ours.unit_bin, ref.unit_bin)
    np.testing.assert_array_equal(ours.cost, ref.cost)
    np.testing.assert_array_equal(ours.tokens, ref.tokens)
    assert (ours.tokens <= 4096).all() or preload
