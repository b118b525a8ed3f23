"""balancer.integrations.torchft without processes: a step planned over any number of groups keeps every piece
(hypothesis), measured speeds per replica_id, and the data layer over a real torchft Manager in this process (one
replica group, torchft's own lighthouse in-process): an epoch exactly once, an uncommitted step served again, a
state resumed onto another topology.dp. The multi-process runs with kill -9 are in test_torchft_faults.py."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.restarts import token_coverage
from support.torchft_fixtures import COST, lengths_of, solo_manager

import balancer
from balancer.integrations.torchft import FaultTolerantBatches, ReplicaSpeeds, StepPieces, plan_step
from balancer.training.indices import Span

torchft = pytest.importorskip("torchft", reason="torchft is installed by the test extras (tools/setup.sh test)")


def walk(batches: FaultTolerantBatches, manager, steps=None, commit=lambda i: True) -> list:
    """Run steps (all, or `steps`) and return every committed step's pieces."""
    out, i = [], 0
    while steps is None or i < steps:
        manager.start_quorum()
        items = batches.next_step(manager)
        if items is None:
            break
        ok = manager.should_commit() and commit(i)
        if ok:
            out.append((items, batches.loss_tokens()))
        batches.end_step(ok)
        i += 1
    return out


def covered(steps: list, lengths) -> np.ndarray:
    return token_coverage((x for items, _ in steps for mb in items for x in mb), lengths)


def test_an_epoch_comes_exactly_once_over_a_real_manager():
    lengths = lengths_of(600)
    topo = balancer.Topology(dp=3, micro_batches=2, max_tokens=128, tokens_per_step=600)
    b = FaultTolerantBatches(lengths, topo, COST, replica_id="solo", window_docs=200, overflow="split")
    with solo_manager() as (manager, _):
        steps = walk(b, manager)
    seen = covered(steps, lengths)
    assert seen.min() == 1 and seen.max() == 1
    assert len(steps) == b.windows.total_steps() == b.committed_steps
    assert any(isinstance(x, Span) for items, _ in steps for mb in items for x in mb)  # split documents as spans
    for items, loss_tokens in steps:  # one group takes the whole step: dp * M micro-batches' worth
        sizes = [(x.end - x.start) if isinstance(x, Span) else int(lengths[int(x)]) for mb in items for x in mb]
        assert loss_tokens == sum(s - 1 for s in sizes)
        assert len(items) >= topo.dp * topo.micro_batches - 1
    with solo_manager() as (manager, _):
        assert walk(b, manager) == []  # the epoch is done until set_epoch
        b.set_epoch(1)
        assert covered(walk(b, manager), lengths).max() == 1


def test_an_uncommitted_step_is_served_again_and_nothing_is_lost():
    lengths = lengths_of(300, seed=1)
    topo = balancer.Topology(dp=2, micro_batches=2, max_tokens=128, tokens_per_step=400)
    b = FaultTolerantBatches(lengths, topo, COST, replica_id="solo", window_docs=300, overflow="split")
    with solo_manager(async_quorum=True) as (manager, _):
        manager.start_quorum()
        first = b.next_step(manager)
        manager.should_commit()
        b.end_step(False)
        manager.start_quorum()
        assert b.next_step(manager) == first
        b.end_step(manager.should_commit())
        rest = walk(b, manager, commit=lambda i: i % 3 != 1)
    seen = covered([(first, 0)] + rest, lengths)
    assert seen.min() == 1 and seen.max() == 1


def test_a_process_group_aborted_after_a_failed_step_is_rebuilt_by_the_next_quorum():
    """The recommended loop line `pg.abort()` after a step that did not commit (docs/fault-tolerance.md): torchft
    makes a new quorum id after a failed commit and rebuilds the process group, so the next step reduces and
    commits, and the uncommitted step's documents come again."""
    import torch
    from torch.distributed import ReduceOp

    lengths = lengths_of(200, seed=4)
    topo = balancer.Topology(dp=2, micro_batches=2, max_tokens=128, tokens_per_step=400)
    b = FaultTolerantBatches(lengths, topo, COST, replica_id="solo", window_docs=200, overflow="split")
    with solo_manager(async_quorum=True) as (manager, pg):
        manager.start_quorum()
        first = b.next_step(manager)
        manager.report_error(RuntimeError("a peer failed"))  # as a failed reduction reports it
        assert not manager.should_commit()
        pg.abort()
        b.end_step(False)
        manager.start_quorum()
        assert b.next_step(manager) == first
        grad = torch.ones(3)
        manager.allreduce(grad, reduce_op=ReduceOp.SUM).wait()
        assert manager.errored() is None and grad.tolist() == [1.0, 1.0, 1.0]
        assert manager.should_commit()
        b.end_step(True)
        rest = walk(b, manager)
    seen = covered([(first, 0)] + rest, lengths)
    assert seen.min() == 1 and seen.max() == 1


def test_a_state_resumes_onto_another_dp_every_document_once():
    lengths = lengths_of(900, seed=2)
    t3 = balancer.Topology(dp=3, micro_batches=2, max_tokens=128, tokens_per_step=700)
    t2 = balancer.Topology(dp=2, micro_batches=3, max_tokens=128, tokens_per_step=700)
    b3 = FaultTolerantBatches(lengths, t3, COST, replica_id="solo", window_docs=300, overflow="split", seed=5)
    with solo_manager() as (manager, _):
        before = walk(b3, manager, steps=7)
    state = b3.state_dict()
    b2 = FaultTolerantBatches(lengths, t2, COST, replica_id="solo", window_docs=300, overflow="split", seed=5)
    b2.load_state_dict(state)
    with solo_manager() as (manager, _):
        after = walk(b2, manager)
    seen = covered(before + after, lengths)
    assert seen.min() == 1 and seen.max() == 1
    with pytest.raises(ValueError, match="seed"):
        FaultTolerantBatches(lengths, t2, COST, replica_id="x", window_docs=300, overflow="split").load_state_dict(
            state
        )


@settings(max_examples=60, deadline=None)
@given(
    groups=st.integers(1, 4), dp=st.integers(1, 4), m=st.integers(1, 3), seed=st.integers(0, 10_000),
    slow=st.floats(0.2, 1.0), long_share=st.floats(0, 1),
)  # fmt: skip
def test_a_step_planned_over_any_contributors_keeps_every_piece(groups, dp, m, seed, slow, long_share):
    """Steps as a window plan makes them (dp * m micro-batches of at most 128 tokens, one piece or more each, some
    pieces parts of longer documents) planned over any number of groups up to dp, with or without speeds."""
    groups = min(groups, dp)
    rng = np.random.default_rng(seed)
    sizes = []
    for _ in range(dp * m):  # a failure-free micro-batch: one long piece, or a few short ones
        sizes += (
            [int(rng.integers(65, 129))] if rng.random() < long_share else list(rng.integers(2, 40, rng.integers(1, 4)))
        )
    n = len(sizes)
    start = np.where(rng.random(n) < 0.3, rng.integers(0, 50, n), 0)
    end = start + np.array(sizes)
    full = end + np.where(rng.random(n) < 0.5, 0, rng.integers(1, 30, n))
    pieces = StepPieces(np.arange(n), start, end, full, m)
    topo = balancer.Topology(dp=dp, micro_batches=m, max_tokens=128)
    speeds = None if groups == 1 else tuple([slow] + [1.0] * (groups - 1))
    plan = plan_step(pieces, topo, COST, groups, speeds, seed)
    assert len(plan.items) == groups
    got = {}
    for mine in plan.items:
        assert len(mine) <= plan.micro_batches
        for mb in mine:
            assert mb and sum(x.end - x.start if isinstance(x, Span) else int(full[x]) for x in mb) <= 128
            for x in mb:
                d, a, b = (x.doc, x.start, x.end) if isinstance(x, Span) else (int(x), 0, int(full[x]))
                assert isinstance(x, Span) or (start[d] == 0 and end[d] == full[d])  # whole documents as ints
                got.setdefault(d, []).append((a, b))
    assert sorted(got) == list(range(n))
    for d in range(n):  # every piece exactly once
        assert got[d] == [(start[d], end[d])]
    assert plan_step(pieces, topo, COST, groups, speeds, seed).items == plan.items  # deterministic


def test_a_slower_group_is_planned_less_work():
    rng = np.random.default_rng(3)
    full = rng.integers(10, 120, 80)
    pieces = StepPieces(np.arange(80), np.zeros(80, dtype=np.int64), full, full, 4)
    topo = balancer.Topology(dp=2, micro_batches=4, max_tokens=512)
    plan = plan_step(pieces, topo, COST, 2, (0.5, 1.0), 0)
    assert plan.costs[0] < 0.7 * plan.costs[1]
    assert max(plan.times) < 1.15 * min(plan.times)


def test_replica_speeds_notice_a_slowdown_and_a_stall_by_identity(caplog):
    s = ReplicaSpeeds(stall_seconds=5.0)
    caplog.set_level(logging.INFO)
    for step in range(12):
        s.members_at(step, ["a", "b"] if step < 10 else ["a"])
        s.observe(step, "a", 100.0, 1.0)
        s.observe(step, "b", 100.0, 1.0 if step < 6 else 2.0)  # b runs at half speed from step 6
    report = s.report()
    slowed = [e for e in report["slowed"] if e["replica_id"] == "b"]
    assert slowed and 6 <= slowed[0]["step"] <= 6 + s.recent
    assert report["slowed_now"] == ["b"] and report["speeds"]["b"] == pytest.approx(50.0)
    assert [e["replica_id"] for e in report["departed"]] == ["b"]
    s.observe(12, "a", 100.0, 9.0)
    assert s.report()["stalled"][0]["replica_id"] == "a"
    assert "replica b slowed down" in caplog.text and "replica a stalled" in caplog.text
    again = ReplicaSpeeds()
    again.load_state_dict(s.state_dict())
    assert again.report() == s.report()


def test_bad_arguments_are_refused_naming_them():
    lengths = lengths_of(100)
    topo = balancer.Topology(dp=2, micro_batches=2, max_tokens=512, tokens_per_step=1000)
    with pytest.raises(ValueError, match="replica_id"):
        FaultTolerantBatches(lengths, topo, COST, replica_id="")
    with pytest.raises(ValueError, match="rank_speeds"):
        FaultTolerantBatches(lengths, balancer.Topology(dp=2, max_tokens=512, rank_speeds=(1.0, 0.5)), COST,
                             replica_id="a")  # fmt: skip
    with pytest.raises(ValueError, match="mode"):
        FaultTolerantBatches(lengths, topo, COST, replica_id="a", mode="fast")
    with pytest.raises(ValueError, match="document"):
        FaultTolerantBatches(lengths_of(100, top=5000) + 600, topo, COST, replica_id="a")


def test_a_rejoiner_takes_the_window_s_plan_from_the_state_and_plans_nothing(monkeypatch):
    """A group that heals loads the sender's data state, which carries the current window's plan from the step on:
    the rejoiner's first step pieces come from it without planning the window (the others would wait for that),
    equal to the sender's; its data state equals the sender's; the epoch's documents once over both."""
    from balancer.training import segments

    lengths = lengths_of(900, seed=2)
    topo = balancer.Topology(dp=3, micro_batches=2, max_tokens=128, tokens_per_step=700)

    def fresh() -> FaultTolerantBatches:
        return FaultTolerantBatches(lengths, topo, COST, replica_id="solo", window_docs=300, overflow="split", seed=5)

    sender = fresh()
    with solo_manager() as (manager, _):
        before = walk(sender, manager, steps=1)
    state = sender.state_dict()
    assert state["plan"] is not None and state["plan"]["first"] == 1 and state["plan"]["steps"] > 2  # first half
    planned = []
    real = segments.plan_units
    monkeypatch.setattr(segments, "plan_units", lambda *a, **k: planned.append(1) or real(*a, **k))
    rejoiner = fresh()
    rejoiner.load_state_dict(state)
    mine, theirs = rejoiner.pieces(), sender.pieces()
    assert planned == []  # the window was not planned again
    assert all(np.array_equal(getattr(mine, f), getattr(theirs, f)) for f in ("doc", "start", "end", "full"))
    assert mine.micro_batches == theirs.micro_batches and rejoiner.state_dict() == state
    with solo_manager() as (manager, _):
        after = walk(rejoiner, manager)
    seen = covered(before + after, lengths)
    assert seen.min() == 1 and seen.max() == 1
    assert planned  # the next windows were planned as usual


def test_a_state_s_plan_is_used_only_where_it_is_the_receiver_s_window(monkeypatch):
    """Onto another topology the window is planned again (the received plan is not this topology's); a state
    without a plan (an older one) loads and plans; a malformed plan is refused naming it."""
    from balancer.training import segments

    lengths = lengths_of(900, seed=2)
    t3 = balancer.Topology(dp=3, micro_batches=2, max_tokens=128, tokens_per_step=700)
    t2 = balancer.Topology(dp=2, micro_batches=3, max_tokens=128, tokens_per_step=700)
    sender = FaultTolerantBatches(lengths, t3, COST, replica_id="solo", window_docs=300, overflow="split", seed=5)
    state = sender.state_dict()
    planned = []
    real = segments.plan_units
    monkeypatch.setattr(segments, "plan_units", lambda *a, **k: planned.append(1) or real(*a, **k))
    for topo, sent in ((t2, state), (t3, {**state, "plan": None})):
        planned.clear()
        other = FaultTolerantBatches(lengths, topo, COST, replica_id="solo", window_docs=300, overflow="split", seed=5)
        other.load_state_dict(sent)
        other.pieces()
        assert planned, topo
    bad = {**state, "plan": {**state["plan"], "ptr": state["plan"]["ptr"][:-1]}}
    with pytest.raises(ValueError, match="'plan'"):
        sender.load_state_dict(bad)
