"""`WindowSchedule` (balancer.planning.schedule): which model plans window w of pass e, a new pass, its state, the
segment chain's mid-step rule and the one seed rule the sampler and the stream share."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import balancer
from balancer.planning.schedule import MODEL_CHANGE, WindowSchedule, check_seed, parse_segments, resume_chain
from balancer.strict_json import array, check

TOPO = balancer.Topology(dp=2, micro_batches=2, max_tokens=4096)
COST = balancer.CostModel(1.0, 50.0)
A, B = balancer.CostModel(2.0, 50.0), balancer.CostModel(3.0, 40.0)


def test_the_last_change_at_or_before_a_window_plans_it():
    s = WindowSchedule(TOPO, COST)
    s.update(A, None, 3, epoch=0)
    s.update(B, (1.5, 0.5), 1, epoch=1)
    assert [s.model(0, w)[1] for w in range(5)] == [COST, COST, COST, A, A]
    assert [s.model(1, w)[1] for w in range(3)] == [A, B, B]
    assert s.model(1, 2)[0] == dataclasses.replace(TOPO, rank_speeds=(1.5, 0.5)) and s.model(0, 4)[0] == TOPO
    assert [s.index(e, w) for e, w in ((0, 0), (0, 3), (1, 0), (1, 1), (7, 0))] == [0, 1, 1, 2, 2]
    s.update(COST, None, 2, epoch=1)  # a later call overrides from its own start
    assert [s.model(1, w)[1] for w in range(4)] == [A, B, COST, COST]


def test_a_new_pass_plans_every_window_with_the_latest_model():
    s = WindowSchedule(TOPO, COST)
    s.update(A, None, 2)
    s.update(B, None, 4)
    s.new_pass(1)
    assert [s.model(1, w)[1] for w in range(3)] == [B, B, B]
    assert len(s.changes) == 1 and s.changes[0].start == (1, 0)


def test_bad_updates_are_refused():
    s = WindowSchedule(TOPO, COST)
    with pytest.raises(TypeError, match="cost must be a CostModel"):
        s.update({"attn_coef": 1.0}, None, 0)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="first_window"):
            s.update(A, None, bad)
    with pytest.raises(ValueError, match="rank_speeds"):
        s.update(A, (1.0, 1.0, 1.0), 0)  # three speeds for two replicas
    assert s.changes == []


def test_the_changes_state_round_trips_and_drops_speeds_of_another_dp(caplog):
    s = WindowSchedule(TOPO, COST)
    s.update(A, (1.2, 0.8), 2, epoch=3)
    state = s.changes_state()
    check(state, array(MODEL_CHANGE), "state")
    back = WindowSchedule(TOPO, COST)
    back.load_changes(state, 3, "state")
    assert back.changes == s.changes
    wider = WindowSchedule(dataclasses.replace(TOPO, dp=4), COST)
    wider.load_changes(state, 3, "state")
    assert wider.changes[0].rank_speeds is None and "planning without them" in caplog.text


def _chain(*steps):
    return parse_segments(
        [{"topology": TOPO.to_dict(), "cost": c.to_dict(), "steps": n} for c, n in steps], "test state"
    )


def test_the_mid_step_rule():
    chain = _chain((COST, 3), (A, None))
    assert resume_chain(chain, 5, (TOPO, A), 7) == (chain[:1], 5, 0)  # the same model: any micro-batch
    history, position, consumed = resume_chain(chain, 4, (TOPO, B), 7)  # another model at a step boundary
    assert (position, consumed) == (0, 2) and history[-1] == {"topology": TOPO, "cost": A, "steps": 2}
    with pytest.raises(ValueError, match="mid-step .micro-batch 1 of step 2. of window 7"):
        resume_chain(chain, 5, (TOPO, B), 7)


def test_the_chain_s_schema():
    with pytest.raises(ValueError, match="non-empty"):
        parse_segments([], "test state")
    with pytest.raises(ValueError, match=r"segments\[1\].steps.*null"):
        _chain((COST, 3), (A, 2))
    with pytest.raises(ValueError, match=r"segments\[0\].steps.*integer"):
        _chain((COST, None), (A, None))


def test_one_seed_rule_for_the_sampler_and_the_stream():
    assert check_seed(2**63 - 1) == 2**63 - 1 and check_seed(np.int64(5)) == 5
    for bad in (-1, 2**63, True, 1.0):
        with pytest.raises(ValueError, match=r"0 \.\. 2\*\*63-1"):
            check_seed(bad)
    from balancer.streaming import BalancedStream

    lengths = np.full(40, 100)
    with pytest.raises(ValueError, match=r"0 \.\. 2\*\*63-1"):
        balancer.BalancedBatchSampler(lengths, TOPO, COST, dp_rank=0, seed=2**63)
    rows = [{"input_ids": list(range(100))} for _ in range(40)]
    one = balancer.Topology(dp=1, micro_batches=2, max_tokens=4096)
    with pytest.raises(ValueError, match=r"0 \.\. 2\*\*63-1"):
        BalancedStream(rows, one, COST, window_docs=8, seed=2**63)
