"""`BalancedBatchSampler.step_info`: one object per step whose figures equal the per-step accessors and the
micro-batches the sampler yields (tokens of every rank's micro-batches summed over the step)."""

from __future__ import annotations

import numpy as np
import pytest

import balancer
from balancer.training import StepInfo

COST = balancer.CostModel(attn_coef=1e-9, linear_coef=1e-6)


@pytest.mark.parametrize("window_docs", [None, 300])
def test_step_info_equals_the_accessors_and_what_is_yielded(window_docs):
    lengths = np.random.default_rng(3).integers(20, 900, 900)
    topo = balancer.Topology(dp=2, micro_batches=2, max_tokens=4096, tokens_per_step=6000)
    samplers = [balancer.BalancedBatchSampler(lengths, topo, COST, dp_rank=r, window_docs=window_docs) for r in (0, 1)]
    yielded = [list(s) for s in samplers]
    s = samplers[0]
    assert s.num_steps > 3
    for step in range(s.num_steps):
        info = s.step_info(step)
        assert isinstance(info, StepInfo) and info.step == step and info.micro_batches == 2
        assert info.loss_tokens == s.step_loss_tokens(step) and info.num_sequences == s.step_num_sequences(step)
        mbs = [mb for rank in yielded for mb in rank[step * 2 : step * 2 + 2]]
        assert info.tokens == s.step_tokens(step) == int(sum(lengths[d] for mb in mbs for d in mb))
        assert info.num_sequences == sum(int(lengths[d] > 1) for mb in mbs for d in mb)
        assert np.array_equal(info.predicted_times, s.predicted_times(step))
        assert info.predicted["imbalance"] == s.predicted_step(step)["imbalance"] >= 1.0 - 1e-12
