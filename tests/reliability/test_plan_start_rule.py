"""The window-wrapping rule has one owner, `balancer.planning.schedule.plan_start`: the sampler and the torchft
monitored steps both call it. Its contract: past an epoch's last window into the next epochs (the current pass with
its own window count, other passes with theirs), and an epoch the holder has left plans from the next one."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import balancer
from balancer.planning.schedule import plan_start
from balancer.training.sampler import BalancedBatchSampler


@settings(max_examples=200, deadline=None)
@given(
    epoch=st.integers(0, 6),
    window=st.integers(0, 40),
    current=st.integers(0, 6),
    here=st.integers(1, 7),
    other=st.integers(1, 7),
)
def test_plan_start_wraps_by_each_pass_count(epoch, window, current, here, other):
    e, w = plan_start(epoch, window, current_epoch=current, current_windows=here, epoch_windows=other)
    if epoch < current and window < other:  # a model for an epoch left behind: the next epoch's start
        assert (e, w) == (current + 1, 0)
        return
    # walk the windows one by one from (epoch, 0): the same place window steps on
    ee, ww = epoch, 0
    for _ in range(window):
        ww += 1
        if ww == (here if ee == current else other):
            ee, ww = ee + 1, 0
    assert (e, w) == ((current + 1, 0) if ee < current else (ee, ww))
    assert w < (here if e == current else other)


def test_plan_start_refuses_empty_counts():
    with pytest.raises(ValueError, match="window counts"):
        plan_start(0, 1, current_epoch=0, current_windows=0, epoch_windows=3)


def test_sampler_delegates_to_the_rule():
    lengths = np.random.default_rng(1).integers(10, 200, 170)
    topo = balancer.Topology(dp=2, micro_batches=2, max_tokens=512)
    s = BalancedBatchSampler(lengths, topo, balancer.CostModel(1.0, 50.0), window_docs=40, seed=3, dp_rank=0)
    s.set_epoch(2)
    count = s.windows.count
    for epoch in range(5):
        for window in range(3 * count):
            expected = plan_start(epoch, window, current_epoch=2, current_windows=count, epoch_windows=count)
            assert s.plan_start(epoch, window) == expected
    assert s.plan_start(2, count) == (3, 0) and s.plan_start(1, 0) == (3, 0)
