"""Sampler states are tied to what was consumed: a state carries a digest of the lengths and of everything that
decides the order and the position (seed, epoch, window size, window, position, segments), so an edited or foreign
state is refused instead of skipping or repeating documents, while what may change on resume (the topology at a step
boundary, a refitted cost model) still resumes every remaining document exactly once."""

from __future__ import annotations

import numpy as np
import pytest
from support.coverage import covered_tokens

import balancer
from balancer.training.sampler_state import state_digest

COST = balancer.CostModel(attn_coef=1.0, linear_coef=50.0)
TOPO = balancer.Topology(dp=2, cp=1, micro_batches=2, max_tokens=512, tokens_per_step=1700)
LENGTHS = np.random.default_rng(4).integers(1, 300, 3000)


def _sampler(rank=0, **kw):
    args = dict(dp_rank=rank, seed=3, window_docs=700) | kw
    return balancer.BalancedBatchSampler(kw.pop("lengths", LENGTHS), kw.pop("topology", TOPO), COST, **args)


def _mid_epoch_state():
    s = _sampler()
    s.set_epoch(1)
    it = iter(s)
    for _ in range(2 * len(s) // 3):  # inside a later window
        next(it)
    return s.state_dict()


@pytest.mark.parametrize(
    "edit",
    [
        {"position": 2},  # a step back: documents repeated
        {"position": 8},  # steps ahead: documents skipped
        {"window": 1},
        {"epoch": 0},
        {"window_docs": 800},
        {"seed": 4},
        {"num_docs": 2999},
    ],
)
def test_an_edited_state_is_refused(edit):
    state = _mid_epoch_state()
    assert state["format_version"] == 3 and state["digest"] == state_digest(state)
    edited = {**state, **edit}
    with pytest.raises(ValueError, match="do not match its digest: the state was edited"):
        _sampler().load_state_dict(edited)


def test_a_consistently_edited_foreign_state_names_what_differs():
    state = _mid_epoch_state()
    other = np.array(LENGTHS)
    other[5] += 1  # another data set of the same size
    foreign = balancer.BalancedBatchSampler(other, TOPO, COST, dp_rank=0, seed=3, window_docs=700)
    with pytest.raises(ValueError, match="another data set.*fingerprint"):
        foreign.load_state_dict(state)
    reseeded = {**state, "seed": 9}
    reseeded["digest"] = state_digest(reseeded)  # a state of another run (or one re-signed by hand)
    with pytest.raises(ValueError, match="from seed 9, this sampler has seed 3"):
        _sampler().load_state_dict(reseeded)


def test_the_digest_ignores_keys_it_does_not_cover():
    state = _mid_epoch_state()
    moved = {**state, "dp_rank": 1, "rank": 1}  # every rank's state is the same position: any rank may load it
    s = _sampler(rank=1)
    s.load_state_dict(moved)
    assert len(list(s)) > 0


def test_a_version_2_state_still_loads():
    state = _mid_epoch_state()
    old = {k: v for k, v in state.items() if k != "digest"} | {"format_version": 2}
    a, b = _sampler(), _sampler()
    a.load_state_dict(state)
    b.load_state_dict(old)
    assert list(a) == list(b)


def test_a_refitted_cost_model_and_a_new_topology_resume_exactly_once():
    """At a step boundary the state resumes onto a refitted cost model or another topology: nothing lost or
    repeated, and the digest (of the saved fields) does not stand in the way."""
    s = [_sampler(rank=r) for r in range(TOPO.dp)]
    its = [iter(x) for x in s]
    consumed = [i for it in its for _ in range(3 * TOPO.micro_batches) for i in next(it)]
    state = s[0].state_dict(position=3 * TOPO.micro_batches)
    refit = balancer.CostModel(attn_coef=3.0, linear_coef=10.0, fixed=5.0)
    for topo, cost in [(TOPO, refit), (balancer.Topology(dp=3, cp=1, micro_batches=3, max_tokens=512), COST)]:
        new = [balancer.BalancedBatchSampler(LENGTHS, topo, cost, dp_rank=r, seed=3, window_docs=700)
               for r in range(topo.dp)]  # fmt: skip
        for x in new:
            x.load_state_dict(state)
        rest = [list(x) for x in new]
        assert len({len(r) for r in rest}) == 1 and all(len(r) == len(x) for r, x in zip(rest, new))
        items = consumed + [i for r in rest for mb in r for i in mb]
        assert covered_tokens(items, LENGTHS) == covered_tokens(range(len(LENGTHS)), LENGTHS)
