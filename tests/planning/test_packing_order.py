"""largest_first: always the stable descending cost order, whether or not the costs follow the tokens."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer.planning.cost.model import CostModel
from balancer.planning.packing.order import largest_first


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(0, 400),
    high=st.sampled_from([2, 50, 4096, 1 << 20]),
    costs=st.sampled_from(["model", "linear", "shuffled", "constant"]),
    seed=st.integers(0, 2**31),
)
def test_largest_first_is_the_stable_order(n, high, costs, seed):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, high, n)
    cost = {
        "model": lambda: CostModel(attn_coef=2 / 53000, linear_coef=1.0).cost(tokens),
        "linear": lambda: tokens.astype(np.float64),
        "shuffled": lambda: rng.permutation(tokens).astype(np.float64),  # costs that do not follow the tokens
        "constant": lambda: np.ones(n),
    }[costs]()
    assert np.array_equal(largest_first(cost, tokens), np.argsort(-cost, kind="stable"))
