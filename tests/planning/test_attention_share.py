"""`CostModel.attention_cost`: the attention terms of a document's cost (what the planner's attention share is made
of), so that a per-token term never counts as attention."""

from __future__ import annotations

import numpy as np
import pytest

import balancer

MODELS = [
    balancer.CostModel(1.0, 50.0),
    balancer.CostModel(3e-12, 2e-8, fixed=1e-4, piece_coef=4e-5, window=4096),
    balancer.CostModel(1.0, 1000.0, causal=False, piece_coef=7.0),
    balancer.CostModel(0.0, 1.0),
]


@pytest.mark.parametrize("cost", MODELS)
def test_attention_cost_is_the_attention_terms(cost):
    d = np.array([0, 1, 2, 17, 4096, 100_000])
    attention = cost.attention_cost(d)
    expected = cost.attn_coef * cost.pairs(d) + cost.piece_coef * (d > 0)
    assert np.array_equal(attention, expected)
    np.testing.assert_allclose(attention + cost.linear_coef * d, cost.cost(d), rtol=1e-15)


def test_per_token_work_is_not_attention():
    linear_only = balancer.CostModel(0.0, 5.0)
    assert not linear_only.attention_cost(np.array([10, 10_000])).any()
