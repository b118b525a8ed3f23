"""BalanceMonitor on FaultTolerantBatches (a StepSource whose one unit is this replica group): over a real torchft
Manager (one group, torchft's lighthouse in this process) the monitor measures exactly the committed steps, with the
pieces the group ran; in adapt mode its fitted cost model becomes the group's proposal, which plans the steps from
the window it names; the monitor's state travels in the data state; the proposal rule picks the same model on every
group. The multi-group runs with kill -9 and a slowed replica are in test_torchft_faults.py."""

from __future__ import annotations

import time

import numpy as np
import pytest

import balancer
from balancer.integrations.torchft import FaultTolerantBatches
from balancer.integrations.torchft.exchange import FIT, Row
from balancer.integrations.torchft.monitored import pack_fit, piece_lengths, plan_cost
from balancer.measured import BalanceMonitor, StepSource
from balancer.measured.source import STEP_SOURCE_MEMBERS

pytest.importorskip("torchft", reason="torchft is installed by the test extras (tools/setup.sh test)")
from support.torchft_fixtures import COST, lengths_of, solo_manager  # noqa: E402

TOPO = balancer.Topology(dp=3, micro_batches=2, max_tokens=128, tokens_per_step=600)


def batches(**kw) -> FaultTolerantBatches:
    return FaultTolerantBatches(lengths_of(600), TOPO, COST, replica_id="solo", window_docs=200, overflow="split", **kw)


def run(b: FaultTolerantBatches, manager, commit=lambda i: True, steps=None) -> list:
    """Steps with every micro-batch timed (a sleep in proportion to its cost); the committed steps' micro-batches."""
    out, i = [], 0
    while steps is None or i < steps:
        manager.start_quorum()
        items = b.next_step(manager)
        if items is None:
            break
        for mb in items:
            with b.timer():
                time.sleep(1e-7 * COST.micro_batch_cost(piece_lengths(mb, b.lengths)))
        ok = manager.should_commit() and commit(i)
        if ok:
            out.append(items)
        b.end_step(ok)
        i += 1
    return out


def test_it_is_a_step_source_and_the_monitor_measures_the_committed_steps():
    b = batches()
    assert isinstance(b, StepSource), [n for n in STEP_SOURCE_MEMBERS if not hasattr(b, n)]
    monitor = BalanceMonitor(b, cuda=False, warmup_steps=0)
    assert b.monitor is monitor and b.topology.dp == 1 and b.topology.micro_batches == TOPO.dp * TOPO.micro_batches
    assert b.run_topology == TOPO
    with solo_manager() as (manager, _):
        committed = run(b, manager, commit=lambda i: i % 4 != 2)  # every fourth step fails to commit
    steps = monitor.ledger.steps
    assert len(steps) == len(committed) == b.epoch_steps == b.committed_steps
    assert [s["step"] for s in steps] == list(range(len(committed)))
    for k in range(len(committed) - 10, len(committed)):  # the pieces the monitor read are those the group ran
        for m in range(b.topology.micro_batches):
            got = b.piece_sizes(k, m)[0]
            want = piece_lengths(committed[k][m], b.lengths) if m < len(committed[k]) else np.zeros(0)
            assert got.tolist() == want.tolist()
    assert all(s["measured"][0] > 0 for s in steps)
    assert monitor.report()["steps"] == len(committed)


def test_adapt_mode_proposes_the_fit_and_plans_the_steps_from_its_window_with_it():
    b = batches()
    monitor = BalanceMonitor(b, mode="adapt", cuda=False, warmup_steps=1, min_samples=16)
    with solo_manager() as (manager, _):
        run(b, manager)
    accepted = [r for r in monitor.refits if r["accepted"]]
    assert accepted and b.fits, monitor.refits
    assert [(e, w, c) for e, w, c in b.fits] == [(*m.start, m.cost) for m in monitor.models[1:]]
    epoch, window, cost = b.fits[0]
    fitted = [s["fitted"] for s in b.log]
    first = next(i for i, s in enumerate(b.log) if s["position"][:2] >= [epoch, window])
    assert not any(fitted[:first]) and all(fitted[first:]) and first > 0
    again = batches()  # the monitor's state and the proposal travel in the data state
    resumed = BalanceMonitor(again, mode="adapt", cuda=False)
    again.load_state_dict(b.state_dict())
    assert again.fits == b.fits and len(resumed.ledger.steps) == len(monitor.ledger.steps)
    assert resumed.models[-1].cost == monitor.models[-1].cost


def test_every_group_plans_with_the_first_contributor_s_proposal_in_force():
    fast = balancer.CostModel(attn_coef=2e-9, linear_coef=3e-7)
    slow = balancer.CostModel(attn_coef=5e-9, linear_coef=1e-7)

    def row(slot: int, fit: tuple) -> Row:
        return Row(slot, f"g{slot}", 0, 3, 1, 0, False, 10, 12, 0.0, 0.0, 0.0, fit)

    later, now, other = pack_fit(fast, 0, 5), pack_fit(slow, 0, 2), pack_fit(fast, 0, 3)
    assert plan_cost([row(0, later), row(1, now), row(2, other)], COST) == slow  # row 0's is not in force yet
    assert plan_cost([row(0, pack_fit(None, 0, 0)), row(2, other)], COST) == fast
    assert plan_cost([row(1, (0.0,) * FIT)], COST) == COST
    encoded = Row.decode(1, row(1, now).encode())
    assert encoded == row(1, now)


def test_a_monitor_needs_every_micro_batch_timed():
    b = batches()
    BalanceMonitor(b, cuda=False)
    with solo_manager() as (manager, _):
        manager.start_quorum()
        items = b.next_step(manager)
        b.record(0.01)
        assert len(items) > 1
        with pytest.raises(RuntimeError, match="timed of"):
            b.end_step(manager.should_commit())


def test_bad_cp_rank_and_an_old_state_are_refused():
    with pytest.raises(ValueError, match="cp_rank"):
        batches(cp_rank=1)
    state = batches().state_dict()
    del state["epoch_steps"]
    with pytest.raises(ValueError, match="epoch_steps"):
        batches().load_state_dict(state)
