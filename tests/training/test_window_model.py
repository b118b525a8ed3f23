"""`EpochWindows.update_model`: windows from `first_window` on are planned with the new model (plans already made
for them are dropped), earlier windows keep theirs, every document still comes exactly once, the step counts stay,
and a count that would change is an error."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from support.coverage import covered_tokens

import balancer

COST = balancer.CostModel(attn_coef=1.0, linear_coef=50.0)
NEW = balancer.CostModel(attn_coef=3.0, linear_coef=20.0, fixed=5.0)
TOPO = balancer.Topology(dp=2, micro_batches=2, max_tokens=512, tokens_per_step=1200)
LENGTHS = np.random.default_rng(3).integers(20, 200, 300)
WINDOW = 60


def _sampler(rank=0):
    return balancer.BalancedBatchSampler(LENGTHS, TOPO, COST, dp_rank=rank, seed=1, window_docs=WINDOW)


def _all_ranks(samplers):
    return [item for s in samplers for mb in s for item in mb]


def test_windows_from_first_window_use_the_new_model():
    s = _sampler()
    ew = s.windows
    assert ew.count == 5
    before = [ew.segment(w) for w in range(ew.count)]  # every window planned once with the old model
    ew.plan_ahead(3)
    ew.update_model(NEW, None, 2)
    for w in range(ew.count):
        assert ew.model(w) == (TOPO, NEW if w >= 2 else COST)
    for w in range(ew.count):
        seg = ew.segment(w)
        assert seg.cost == (NEW if w >= 2 else COST)
        assert seg.num_steps == before[w].num_steps
    ew.update_model(COST, None, 4)  # a second update overrides from its own first window
    assert [ew.model(w)[1] for w in range(5)] == [COST, COST, NEW, NEW, COST]


def test_every_document_once_when_the_model_changes_mid_epoch():
    samplers = [_sampler(r) for r in range(TOPO.dp)]
    items = []
    for s in samplers:
        it = iter(s)
        first = s.windows.steps(0) * TOPO.micro_batches
        items += [next(it) for _ in range(first)]  # window 0 with the old model
        s.windows.update_model(NEW, None, 1)
        items += list(it)
        assert s.windows.segment(2).cost == NEW
    got = covered_tokens([i for mb in items for i in mb], LENGTHS)
    assert got == covered_tokens(range(len(LENGTHS)), LENGTHS)


def test_same_plans_as_a_sampler_built_with_the_new_model():
    s = _sampler()
    s.windows.update_model(NEW, None, 0)
    fresh = balancer.BalancedBatchSampler(LENGTHS, TOPO, NEW, dp_rank=0, seed=1, window_docs=WINDOW)
    assert list(s) != [] and list(s) == list(fresh)


def test_rank_speeds_go_into_the_topology():
    ew = _sampler().windows
    if "rank_speeds" not in {f.name for f in dataclasses.fields(balancer.Topology)}:
        with pytest.raises(ValueError, match="takes no rank_speeds"):
            ew.update_model(NEW, (1.0, 0.5), 1)
        return
    ew.update_model(NEW, (1.0, 0.5), 1)
    assert ew.model(0)[0] == TOPO and ew.model(1)[0] == dataclasses.replace(TOPO, rank_speeds=(1.0, 0.5))
    assert ew.segment(1).topology.rank_speeds == (1.0, 0.5)


def test_bad_arguments_and_a_changed_count():
    ew = _sampler().windows
    with pytest.raises(TypeError, match="cost must be a CostModel"):
        ew.update_model({"attn_coef": 1}, None, 1)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="first_window"):
            ew.update_model(NEW, None, bad)
    ew.segment(1)
    ew._steps[1] += 1  # as if the count had been published from another plan
    ew.update_model(NEW, None, 1)
    with pytest.raises(RuntimeError, match="step count must not depend"):
        ew.segment(1)
