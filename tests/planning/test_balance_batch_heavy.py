"""balance_batch's near-linear path (>= 2,048 documents) on batches where one document outweighs a replica's share
(prolong-like long-context traces): the replica holding it must not also take a share of the rest. Reference: LPT
on the same batch (largest cost first, each to the least loaded replica) bounds the slowest replica by the larger of
the heaviest document and the mean plus the smallest document's cost; the plan stays within a small factor of it."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import balancer

COST = balancer.CostModel(attn_coef=3.7735849056603776e-05, linear_coef=1.0)


def _replica_work(plan, lengths) -> np.ndarray:
    c = np.asarray(COST.cost(lengths), dtype=np.float64)
    mb = np.repeat(np.arange(len(plan.mb_ptr) - 1), np.diff(plan.mb_ptr))
    return np.bincount(mb // plan.topology.micro_batches, weights=c[plan.doc], minlength=plan.topology.dp)


def _bound(lengths, dp: int) -> float:
    c = np.asarray(COST.cost(lengths), dtype=np.float64)
    return max(float(c.max()), float(c.sum()) / dp)


def _batch(seed: int, n: int, heavy: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(200, 4000, size=n)
    lengths[rng.integers(n)] = heavy
    return lengths


def test_one_heavy_document_keeps_its_replica_light():
    # 4,096 documents, dp 8: the heavy one (~1.05x a replica's share) and the back-and-forth deal used to give its
    # replica 1/8 of the rest too, more than the pair search moved off again (prolong dp8 M4: 1.21x, 1.25x)
    lengths = _batch(0, 4096, 250_000)
    topo = balancer.Topology(dp=8, micro_batches=4, max_tokens=524_288)
    plan = balancer.balance_batch(lengths, topo, COST, seed=0)
    plan.validate()
    assert plan.topology.max_tokens == topo.max_tokens
    assert _replica_work(plan, lengths).max() <= 1.02 * _bound(lengths, 8)


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(2048, 3000),
    heavy=st.integers(200_000, 400_000),
    dp=st.sampled_from([4, 8]),
)
def test_never_far_from_the_lpt_bound(seed, n, heavy, dp):
    lengths = _batch(seed, n, heavy)
    topo = balancer.Topology(dp=dp, micro_batches=4, max_tokens=524_288)
    plan = balancer.balance_batch(lengths, topo, COST, seed=0)
    plan.validate()
    c = np.asarray(COST.cost(lengths), dtype=np.float64)
    lpt_bound = max(float(c.max()), float(c.sum()) / dp + float(c.min()))  # LPT's slowest replica is within this
    assert _replica_work(plan, lengths).max() <= 1.02 * lpt_bound
