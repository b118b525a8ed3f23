"""Even ranks: every step's replica shares are dealt to the replicas in a seeded permutation, so no replica holds
the longest documents step after step (a straggler a wrong cost model would make, and a speed a measured fit could
not tell from its work); each step keeps the same shares, every unit once, the same metrics; uneven speeds keep the
shares where the planner sized them."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import balancer
from balancer.data.traces import load_trace
from balancer.planning.packing.replicas import permute_replicas

COST = balancer.CostModel(attn_coef=2.7e-8, linear_coef=2.2e-5, fixed=8e-3)


def _blocks(positions, sizes, dp, m):
    """Per step, the replica shares as tuples of unit tuples."""
    ends = np.cumsum(sizes.ravel())
    bins = np.split(positions, ends[:-1])
    return [[tuple(tuple(bins[(s * dp + r) * m + j]) for j in range(m)) for r in range(dp)] for s in range(len(sizes))]


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 5), st.integers(1, 3), st.integers(1, 6), st.integers(0, 10**6))
def test_each_step_keeps_its_shares_in_some_order(dp, m, steps, seed):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 4, (steps, dp * m))
    positions = rng.permutation(int(sizes.sum()))
    topo = balancer.Topology(dp=dp, micro_batches=m, max_tokens=64)
    [(new_pos, new_sizes)] = permute_replicas([(positions, sizes)], topo, np.random.default_rng(seed))
    before, after = _blocks(positions, sizes, dp, m), _blocks(new_pos, new_sizes, dp, m)
    for b, a in zip(before, after):
        assert sorted(b) == sorted(a)
    assert sorted(new_pos.tolist()) == sorted(positions.tolist())
    again = permute_replicas([(positions, sizes)], topo, np.random.default_rng(seed))
    assert np.array_equal(again[0][0], new_pos)


def _costliest_replica(plan):
    costs = plan.micro_batch_costs()  # [steps, dp, M]
    return np.bincount(costs.max(axis=2).argmax(axis=1), minlength=plan.topology.dp)


def test_no_replica_holds_the_longest_documents_step_after_step():
    lengths = np.maximum(16, np.asarray(load_trace("wlbllm")) // 16)[:4000]
    topo = balancer.Topology(dp=4, micro_batches=2, max_tokens=8192, tokens_per_step=24_576)
    plan = balancer.plan(lengths, topo, COST, seed=0)
    plan.validate()
    held = _costliest_replica(plan)
    assert held.min() >= plan.num_steps // 10, held  # before: replica 0 in 38 of 40 steps
    assert np.array_equal(np.sort(plan.doc), np.arange(len(lengths)))
    fast = balancer.plan(lengths, dataclasses.replace(topo, rank_speeds=(3.0, 1.0, 1.0, 1.0)), COST)
    assert _costliest_replica(fast)[0] == fast.num_steps  # uneven speeds: the fast replica takes them, unpermuted
