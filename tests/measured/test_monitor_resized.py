"""A monitor state saved on 2 replicas resumed by a monitor on 1 (an elastic restart onto a smaller DP size, as
torchrun's agents make it): the per-replica records of the old run are left behind (before: the report and the
refit indexed the old replicas and failed), the run goes on to the end of the epoch with every document once, the
monitor measures and refits on its own replica, and a state saved before the unit count was recorded is told by
the width of its measured steps."""

from __future__ import annotations

import json

import pytest
from support.coverage import covered_tokens
from test_monitor import FLOPS, LENGTHS, fake_seconds

import balancer
from balancer.measured import BalanceMonitor

TWO = balancer.Topology(dp=2, micro_batches=2, max_tokens=1024, tokens_per_step=1600)
ONE = balancer.Topology(dp=1, micro_batches=4, max_tokens=1024, tokens_per_step=1600)


def _head(steps: int) -> tuple[dict, list]:
    """`steps` steps on dp=2 (rank 0 monitored, rank 1's micro-batches alongside): the saved state, every
    micro-batch trained."""
    ranks = [balancer.BalancedBatchSampler(LENGTHS, TWO, FLOPS, dp_rank=r, seed=0, window_docs=160) for r in (0, 1)]
    monitor = BalanceMonitor(ranks[0], mode="adapt")
    iters, seen = [iter(s) for s in ranks], []
    for _ in range(steps):
        for _ in range(TWO.micro_batches):
            mbs = [next(it) for it in iters]
            seen += mbs
            monitor.record(fake_seconds(mbs[0], LENGTHS))
        monitor.end_step()
    assert not monitor.refits or not any(r["accepted"] for r in monitor.refits)  # the plans of both ranks agree
    return json.loads(json.dumps(ranks[0].state_dict())), seen


@pytest.mark.parametrize("recorded", [True, False])  # the state names its units / an older state without them
def test_a_two_replica_state_resumes_on_one(recorded):
    state, seen = _head(40)
    assert state["monitor"]["units"] == 2 and len(state["monitor"]["ledger"]["steps"]) == 40
    if not recorded:
        del state["monitor"]["units"]
    sampler = balancer.BalancedBatchSampler(LENGTHS, ONE, FLOPS, dp_rank=0, seed=0, window_docs=160)
    monitor = BalanceMonitor(sampler, mode="adapt")
    sampler.load_state_dict(state)
    assert monitor.ledger.steps == [] and len(monitor.ledger.samples) == 0 and len(monitor.models) == 1
    steps = 0
    for i, mb in enumerate(sampler):
        seen.append(mb)
        monitor.record(fake_seconds(mb, LENGTHS))
        if i % ONE.micro_batches == ONE.micro_batches - 1:
            monitor.end_step()
            steps += 1
    assert covered_tokens([i for mb in seen for i in mb], LENGTHS) == covered_tokens(range(len(LENGTHS)), LENGTHS)
    report = monitor.report()
    assert report["steps"] == steps and report["rank_speeds"] is None
    assert any(r["accepted"] for r in monitor.refits) and len(monitor.models) > 1  # fitted on its own replica
    assert all(len(s["measured"]) == 1 for s in monitor.ledger.steps)
