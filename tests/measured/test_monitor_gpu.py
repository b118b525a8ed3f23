"""The monitor's CUDA path: micro-batches timed with CUDA events, read at the next end_step (the stream is never
synchronised inside the step), the figures equal to the events' elapsed times. Skips cleanly without a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import balancer
from balancer.measured import BalanceMonitor

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_events_are_read_one_step_later():
    lengths = np.random.default_rng(0).integers(20, 400, 300)
    topo = balancer.Topology(dp=1, micro_batches=2, max_tokens=1024, tokens_per_step=1600)
    s = balancer.BalancedBatchSampler(lengths, topo, balancer.CostModel(1.0, 10.0), dp_rank=0, seed=0)
    mon = BalanceMonitor(s, cuda=True)
    x = torch.randn(2048, 2048, device="cuda")
    it = iter(s)
    for step in range(4):
        for _ in range(2):
            next(it)
            with mon.timer():
                for _ in range(5):
                    x = torch.tanh(x @ x)
        mon.end_step()
        assert len(mon.ledger.steps) == step  # the last step's events wait for the next end_step
    mon.flush()
    assert len(mon.ledger.steps) == 4
    assert all(row[2] > 0 for row in mon.ledger.mb)
