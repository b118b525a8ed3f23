"""`BalanceMonitor.log_figures()` (what the balanced trainers log under `balance/` at every logging step) equals
`report()`'s figures exactly, at every step of a run with warm-up, outliers and accepted refits, in both modes,
across a resume that replaces the ledger, and on a replica the monitor never measured (dp = 2, one process)."""

from __future__ import annotations

import json
import math
import zlib

import numpy as np
import pytest

import balancer
from balancer.measured import BalanceMonitor
from balancer.trainers.balance import LOGGED

TRUE = balancer.CostModel(attn_coef=2e-7, linear_coef=3e-5, fixed=1e-3)
FLOPS = balancer.CostModel(attn_coef=1.0, linear_coef=10.0)
LENGTHS = np.random.default_rng(1).integers(20, 400, 480)
KEYS = (*LOGGED, "rank_speeds")


def _sampler(dp: int):
    topo = balancer.Topology(dp=dp, micro_batches=2, max_tokens=1024, tokens_per_step=1600 * dp)
    return balancer.BalancedBatchSampler(LENGTHS, topo, FLOPS, dp_rank=0, seed=0, window_docs=120)


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b and type(a) is type(b)


def _check(monitor) -> None:
    rep, fig = monitor.report(), monitor.log_figures()
    for key in KEYS:
        assert _same(fig[key], rep[key]), (key, fig[key], rep[key])
    assert fig["refits_accepted"] == sum(r["accepted"] for r in rep["refits"])


def _train(sampler, monitor, steps=None) -> int:
    """Fake-timed loop (the true model, 4% noise, two 5x spikes), checking the figures after every step."""
    m, done = sampler.topology.micro_batches, 0
    for i, mb in enumerate(sampler):
        sizes = np.asarray(LENGTHS[np.asarray(mb)])
        spike = 5.0 if (done, i % m) in {(7, 0), (19, 1)} else 1.0
        noise = 1 + 0.04 * (zlib.crc32(repr(mb).encode()) / 2**32 - 0.5)
        monitor.record(TRUE.micro_batch_cost(sizes) * noise * spike)
        if i % m == m - 1:
            monitor.end_step()
            done += 1
            _check(monitor)
            if steps is not None and done == steps:
                break
    return done


@pytest.mark.parametrize("mode,dp", [("adapt", 1), ("shadow", 1), ("shadow", 2)])
def test_log_figures_equal_the_report_at_every_step(mode, dp):
    s = _sampler(dp)
    mon = BalanceMonitor(s, mode=mode)
    _check(mon)  # nothing measured yet
    assert _train(s, mon) == s.num_steps
    if dp == 1:  # with an unmeasured replica (dp = 2 here) no fit is accepted
        assert any(r["accepted"] for r in mon.refits) and mon.log_figures()["fresh_error_median"] > 0
    else:
        assert mon.log_figures()["measured_imbalance"] > 1.5


def test_log_figures_follow_a_resumed_ledger():
    a = _sampler(1)
    ma = BalanceMonitor(a, mode="adapt")
    _train(a, ma, steps=25)
    state = json.loads(json.dumps(a.state_dict()))
    b = _sampler(1)
    mb = BalanceMonitor(b, mode="adapt")
    _train(b, mb, steps=3)  # tables built on this run's own ledger, then replaced by the loaded one
    b.load_state_dict(state)
    _check(mb)
    _train(b, mb)
