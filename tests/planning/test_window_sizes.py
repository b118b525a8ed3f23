"""Every window size the sampler accepts works to the last window (or is refused up front, naming `window_docs`),
and extreme seeds and sizes give loadable plans with finite figures."""

from __future__ import annotations

import math

import numpy as np
import pytest

import balancer
from balancer.planning.window import plan_window

COST = balancer.CostModel(attn_coef=1.0, linear_coef=50.0)
TOPO = balancer.Topology(dp=2, cp=1, micro_batches=3, max_tokens=256, tokens_per_step=1200)  # 6 micro-batches
LENGTHS = np.random.default_rng(1).integers(1, 120, 402)


@pytest.mark.parametrize("window_docs", [7, 8])
def test_a_last_window_that_cannot_fill_a_step_is_refused_up_front(window_docs):
    # 402 documents in windows of 7: the last one holds 3 (not under a quarter window, so it stays apart) and
    # cannot give each of the 6 micro-batches of a step a document
    with pytest.raises(ValueError, match=rf"window_docs = {window_docs} leaves a last window of \d+ .* at least 24"):
        balancer.BalancedBatchSampler(LENGTHS, TOPO, COST, dp_rank=0, window_docs=window_docs)
    with pytest.raises(ValueError, match=f"window_docs = {window_docs}"):
        plan_window(LENGTHS, TOPO, COST, seed=0, epoch=0, index=0, window_docs=window_docs)


@pytest.mark.parametrize("window_docs", [6, 9, 24, 25, 100, 401])
def test_every_accepted_window_size_runs_to_the_last_window(window_docs):
    samplers = [
        balancer.BalancedBatchSampler(LENGTHS, TOPO, COST, dp_rank=r, window_docs=window_docs) for r in range(2)
    ]
    n = len(samplers[0])
    got = [list(s) for s in samplers]
    assert [len(g) for g in got] == [n, n]
    docs = sorted(int(i) for g in got for mb in g for i in mb)
    assert docs == list(range(len(LENGTHS)))


def test_a_window_too_small_for_its_tokens_is_refused_naming_window_docs():
    lengths = np.full(60, 250)
    lengths[::6] = 1  # windows of 6 documents: a step of 6 micro-batches of 256 tokens, some windows hold 5 * 250
    topo = balancer.Topology(dp=2, cp=1, micro_batches=3, max_tokens=256, tokens_per_step=1500)
    s = balancer.BalancedBatchSampler(lengths, topo, COST, dp_rank=0, window_docs=6)
    assert len(s) == len(list(s))  # 250-token rows: one per micro-batch, a window's 6 documents are one step
    many = np.full(60, 200)
    big = balancer.Topology(dp=2, cp=1, micro_batches=2, max_tokens=256, tokens_per_step=900)
    ok = balancer.BalancedBatchSampler(many, big, COST, dp_rank=1, window_docs=8)
    assert len(ok) == len(list(ok))


@pytest.mark.parametrize("seed", [2**63, 2**64 + 7, 10**30])
def test_seeds_a_state_cannot_hold_are_refused_naming_seed(seed):
    with pytest.raises(ValueError, match="seed must be .*2\\*\\*63-1"):
        balancer.BalancedBatchSampler(LENGTHS, TOPO, COST, dp_rank=1, seed=seed, window_docs=100)
    with pytest.raises(ValueError, match="seed must be at most 2\\*\\*63-1"):
        plan_window(LENGTHS, TOPO, COST, seed=seed, epoch=0, index=1, window_docs=100)


@pytest.mark.parametrize("seed", [0, 2**31 - 1, 2**32, 2**63 - 1])
def test_extreme_seeds_give_loadable_plans_with_finite_figures(seed, tmp_path):
    p = plan_window(LENGTHS, TOPO, COST, seed=seed, epoch=3, index=1, window_docs=100)
    p.validate()
    path = tmp_path / "w.json"
    p.save(path)
    q = balancer.Plan.load(path)
    figures = q.metrics()
    assert all(math.isfinite(v) for k, v in figures.items() if isinstance(v, float) and k != "mean_delay_steps")
    s = balancer.BalancedBatchSampler(LENGTHS, TOPO, COST, dp_rank=1, seed=seed, window_docs=100)
    s.set_epoch(2**40)
    assert len(s) == len(list(s)) > 0


def test_extreme_sizes_give_finite_figures():
    huge = np.array([2**40, 2**40 - 3, 5, 7, 9, 11, 13, 17], dtype=np.int64)
    topo = balancer.Topology(dp=2, cp=1, micro_batches=3, max_tokens=2**41, tokens_per_step=2**42)
    p = balancer.plan(huge, topo, COST)
    assert all(math.isfinite(v) for v in p.metrics().values() if isinstance(v, float))
    s = balancer.BalancedBatchSampler(huge, topo, COST, dp_rank=0, window_docs=len(huge))
    assert len(s) == len(list(s))
