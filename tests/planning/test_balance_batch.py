"""balance_batch: one fixed post-training batch over mini-batches, DP ranks and micro-batches (property tests)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import balancer
from balancer.planning.batch.pack import order_for_pipeline, pipeline_times, simulate_1f1b

COST = balancer.CostModel(attn_coef=1 / 2000, linear_coef=1.0)


def _groups_of(plan, groups, keep):
    """(step, place) of every document: place = replica (keep="rank") or micro-batch index (keep="micro_batch")."""
    t = plan.topology
    mb_of_entry = np.repeat(np.arange(len(plan.mb_ptr) - 1), np.diff(plan.mb_ptr))
    step = mb_of_entry // t.bins_per_step
    place = (mb_of_entry // t.micro_batches) % t.dp if keep == "rank" else mb_of_entry
    return {
        int(g): {(int(s), int(p)) for s, p in zip(step[groups[plan.doc] == g], place[groups[plan.doc] == g])}
        for g in np.unique(groups)
    }


def _check_plan(plan, lengths, k):
    plan.validate()  # exactly once, non-empty micro-batches, every one within max_tokens * cp
    assert plan.num_steps == k
    assert plan.num_docs == len(lengths)
    tok = plan.micro_batch_tokens()
    assert tok.max() <= plan.topology.micro_batch_tokens
    if not plan.dynamic:  # every DP rank of every step runs the same number of non-empty micro-batches
        assert tok.shape[1:] == (plan.topology.dp, plan.topology.micro_batches) and tok.min() > 0


batches = st.fixed_dictionaries(
    {
        "n_groups": st.integers(8, 40),
        "group_size": st.integers(1, 4),
        "dp": st.integers(1, 4),
        "cp": st.sampled_from([1, 2]),
        "pp": st.sampled_from([1, 2]),
        "m": st.integers(1, 3),
        "k": st.integers(1, 3),
        "keep": st.sampled_from(["rank", "micro_batch"]),
        "grouped": st.booleans(),
        "equal_counts": st.booleans(),
        "auto": st.booleans(),
        "seed": st.integers(0, 3),
    }
)


@pytest.mark.slow  # hypothesis: ~35 s
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches)
def test_batch_properties(cfg):
    rng = np.random.default_rng(cfg["seed"])
    n = cfg["n_groups"] * cfg["group_size"]
    lengths = np.minimum(rng.lognormal(4.5, 1.0, n).astype(int) + 1, 400)
    groups = np.repeat(np.arange(cfg["n_groups"]), cfg["group_size"]) if cfg["grouped"] else None
    # max_tokens large enough for a group of 4 documents in one micro-batch
    topo = balancer.Topology(dp=cfg["dp"], cp=cfg["cp"], pp=cfg["pp"], micro_batches=cfg["m"], max_tokens=1600)
    k = cfg["k"]
    if cfg["dp"] * cfg["m"] * k > cfg["n_groups"]:
        k = 1
    if cfg["dp"] * cfg["m"] * k > cfg["n_groups"]:
        return  # too few groups to fill every micro-batch (its own error, tested below)
    kwargs = dict(groups=groups, keep=cfg["keep"], mini_batches=k, seed=cfg["seed"])
    kwargs.update(micro_batches="auto" if cfg["auto"] else None, equal_counts=cfg["equal_counts"])
    try:
        try:
            plan = balancer.balance_batch(lengths, topo, COST, **kwargs)
        except ValueError as error:  # a fixed count the batch does not fit: the error says what to do
            assert "equal_counts" in str(error) or not cfg["auto"] and "micro_batches='auto'" in str(error), error
            kwargs["micro_batches"] = "auto"
            plan = balancer.balance_batch(lengths, topo, COST, **kwargs)
    except ValueError as error:  # groups of several documents that cannot be dealt evenly over the ranks
        assert "equal_counts" in str(error) and cfg["equal_counts"] and groups is not None and cfg["group_size"] > 1
        return
    _check_plan(plan, lengths, k)
    t = plan.topology
    if kwargs["micro_batches"] == "auto":
        assert t.micro_batches >= topo.micro_batches
    else:
        assert t.micro_batches == topo.micro_batches
    if groups is not None:  # every group in one place of one step
        assert all(len(places) == 1 for places in _groups_of(plan, groups, cfg["keep"]).values())
    if cfg["equal_counts"]:
        counts = np.diff(plan.mb_ptr).reshape(k, t.dp, t.micro_batches).sum(axis=2)
        assert (counts.max(axis=1) - counts.min(axis=1)).max() <= 1
    again = balancer.balance_batch(lengths, topo, COST, **kwargs)  # a deterministic function of the inputs
    assert np.array_equal(again.doc, plan.doc) and np.array_equal(again.mb_ptr, plan.mb_ptr)
    if cfg["pp"] > 1:  # small micro-batches at both ends, the largest in the middle
        costs = plan.micro_batch_costs()
        for s in range(k):
            for r in range(t.dp):
                c = costs[s, r]
                peak = int(np.argmax(c))
                assert np.all(np.diff(c[: peak + 1]) >= 0) and np.all(np.diff(c[peak:]) <= 0)


@pytest.mark.slow  # hypothesis: ~6 s
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 3), st.integers(1, 2), st.sampled_from(["rank", "micro_batch", None]), st.integers(0, 3))
def test_dynamic_cp_properties(dp, k, keep, seed):
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.lognormal(5, 1.2, 40).astype(int) + 1, 390)
    groups = None if keep is None else np.repeat(np.arange(20), 2)
    sizes = (1, 2, 4) if dp % 2 == 0 else (1, 2)
    topo = balancer.Topology(dp=dp, cp=2, micro_batches=1, max_tokens=400, cp_sizes=sizes)  # pairs fit one rank
    plan = balancer.balance_batch(
        lengths, topo, COST, groups=groups, keep=keep or "rank", micro_batches="auto", mini_batches=k, seed=seed
    )
    plan.validate()  # every token once, groups aligned and covering the pool in every slot, caps per group size
    assert plan.dynamic and plan.num_steps == k
    mb = np.repeat(np.arange(len(plan.mb_ptr) - 1), np.diff(plan.mb_ptr))
    step = plan.step_of_entry()
    for g in range(20) if groups is not None else ():
        where = groups[plan.doc] == g
        assert len(set(step[where])) == 1
        if keep == "micro_batch":
            assert len(set(mb[where])) == 1
    again = balancer.balance_batch(
        lengths, topo, COST, groups=groups, keep=keep or "rank", micro_batches="auto", mini_batches=k, seed=seed
    )
    assert np.array_equal(again.doc, plan.doc) and np.array_equal(again.group_start, plan.group_start)


@pytest.mark.slow  # ~10 s
@settings(max_examples=30, deadline=None)
@given(st.integers(2, 4), st.integers(0, 5), st.booleans())
def test_mini_batches_split_the_work(k, seed, grouped):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(20, 600, 96)
    groups = np.repeat(np.arange(24), 4) if grouped else None
    topo = balancer.Topology(dp=2, micro_batches=2, max_tokens=4096)
    plan = balancer.balance_batch(lengths, topo, COST, groups=groups, mini_batches=k, seed=seed, micro_batches="auto")
    work = np.bincount(plan.step_of_entry(), weights=COST.cost(plan.end - plan.start))
    g = np.arange(96) if groups is None else groups
    heaviest = np.bincount(g, weights=COST.cost(lengths)).max()
    assert len(work) == k
    # each step about 1/k of the work: LPT over the steps (or over k*dp ranks dealt to steps) is off by at most
    # one group per rank
    assert np.abs(work - work.sum() / k).max() <= topo.dp * heaviest


def test_near_the_bound_on_a_grpo_like_batch():
    rng = np.random.default_rng(0)
    lengths = (rng.integers(100, 1000, 64)[:, None] + np.minimum(rng.lognormal(7, 1, (64, 8)), 15000)).astype(int)
    topo = balancer.Topology(dp=8, micro_batches=1, max_tokens=16384)
    cost = balancer.CostModel.from_model(
        hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4, intermediate_size=18944, vocab_size=152064
    )
    for k in (1, 4):
        plan = balancer.balance_batch(lengths.ravel(), topo, cost, micro_batches="auto", mini_batches=k)
        assert plan.metrics()["worst_step"] < 1.01
        counts = plan.metrics()
        assert counts["dropped_tokens"] == 0


def test_auto_micro_batches_grow_only_as_needed():
    lengths = np.full(64, 100)
    big = balancer.Topology(dp=2, micro_batches=2, max_tokens=10_000)
    assert balancer.balance_batch(lengths, big, COST, micro_batches="auto").topology.micro_batches == 2
    small = balancer.Topology(dp=2, micro_batches=2, max_tokens=300)  # 3 documents per micro-batch
    plan = balancer.balance_batch(lengths, small, COST, micro_batches="auto")
    assert plan.topology.micro_batches == 11  # 32 documents per rank, 3 per micro-batch
    plan.validate()
    with pytest.raises(ValueError, match="micro_batches='auto'"):
        balancer.balance_batch(lengths, small, COST)  # None = topology.micro_batches: does not fit


def test_micro_batch_multiple_for_virtual_pipeline_stages():
    lengths = np.full(64, 100)
    small = balancer.Topology(dp=2, micro_batches=2, max_tokens=300)  # "auto" alone gives 11
    plan = balancer.balance_batch(lengths, small, COST, micro_batches="auto", micro_batch_multiple=4)
    assert plan.topology.micro_batches == 12
    plan.validate()
    with pytest.raises(ValueError, match="micro_batch_multiple"):
        balancer.balance_batch(lengths, small, COST, micro_batches=6, micro_batch_multiple=4)
    with pytest.raises(ValueError, match="micro_batch_multiple must be a positive integer"):
        balancer.balance_batch(lengths, small, COST, micro_batches="auto", micro_batch_multiple=0)


def test_dynamic_cp_and_predict():
    rng = np.random.default_rng(1)
    lengths = rng.integers(50, 3000, 64)
    groups = np.repeat(np.arange(32), 2)
    topo = balancer.Topology(dp=2, cp=2, micro_batches=2, max_tokens=4096, cp_sizes=(1, 2, 4))
    for keep in ("rank", "micro_batch"):
        plan = balancer.balance_batch(
            lengths, topo, COST, groups=groups, keep=keep, mini_batches=2, micro_batches="auto"
        )
        plan.validate()
        assert plan.dynamic and plan.num_steps == 2
        mb = np.repeat(np.arange(len(plan.mb_ptr) - 1), np.diff(plan.mb_ptr))
        step = plan.step_of_entry()
        for g in range(32):
            where = groups[plan.doc] == g
            assert len(set(step[where])) == 1
            if keep == "micro_batch":
                assert len(set(mb[where])) == 1
            else:  # on the ranks of one replica of the balancing plan: one aligned block of the largest size
                first = plan.group_start[mb[where]]
                last = first + plan.group_size[mb[where]] - 1
                assert first.min() // 4 == last.max() // 4
        assert plan.predict()["step_time_total"] > 0
    static = balancer.Topology(dp=2, cp=2, micro_batches=2, max_tokens=4096)
    plan = balancer.balance_batch(lengths, static, COST, groups=groups, keep="micro_batch", micro_batches="auto")
    hybrid = plan.predict(layout={"kind": "hybrid", "split_threshold": 1024})
    assert hybrid["step_time_total"] > 0 and np.isfinite(plan.metrics()["imbalance"])


def test_pipeline_order_and_schedule():
    assert simulate_1f1b([1.0] * 4, 3) == pytest.approx((4 + 3 - 1) * 1.0)  # section 3's formula for equal times
    assert simulate_1f1b([1.0, 2.0, 3.0], 1) == 6.0
    assert order_for_pipeline(np.array([5.0, 1.0, 4.0, 2.0, 3.0])).tolist() == [1, 4, 0, 2, 3]
    rng = np.random.default_rng(2)
    lengths = np.concatenate([rng.integers(50, 300, 120), [3000, 2800, 2500, 2600]])
    topo = balancer.Topology(dp=2, pp=4, micro_batches=8, max_tokens=4096)
    ordered = balancer.balance_batch(lengths, topo, COST)
    packed = balancer.balance_batch(lengths, topo, COST, pipeline_order=False)
    assert np.allclose(ordered.step_times(), packed.step_times())  # section-3 metrics do not see the order
    assert pipeline_times(ordered).sum() <= pipeline_times(packed).sum()
    flat = balancer.Topology(dp=2, micro_batches=2, max_tokens=16384)
    plain = balancer.balance_batch(lengths, flat, COST)
    assert np.allclose(pipeline_times(plain), plain.step_times())


def test_equal_counts_with_groups():
    lengths = np.arange(1, 49) * 10
    groups = np.repeat(np.arange(16), 3)
    topo = balancer.Topology(dp=4, micro_batches=1, max_tokens=4096)
    plan = balancer.balance_batch(lengths, topo, COST, groups=groups, equal_counts=True)
    assert np.diff(plan.mb_ptr).tolist() == [12, 12, 12, 12]
    with pytest.raises(ValueError, match="equal_counts"):  # groups of 5 cannot give 4 ranks 12 or 13 of 50
        balancer.balance_batch(np.full(50, 10), topo, COST, groups=np.repeat(np.arange(10), 5), equal_counts=True)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(groups=np.zeros(5, dtype=int)), "groups must hold one group id per document"),
        (dict(groups=np.zeros(40)), "groups must hold integer group ids"),
        (dict(micro_batches=0), "micro_batches must be None, 'auto' or a positive integer"),
        (dict(micro_batches="many"), "micro_batches must be None, 'auto' or a positive integer"),
        (dict(micro_batches=1.5), "micro_batches must be None, 'auto' or a positive integer"),
        (dict(micro_batches=True), "micro_batches must be None, 'auto' or a positive integer"),
        (dict(mini_batches=0), "mini_batches must be a positive integer"),
        (dict(mini_batches=41), "mini_batches=41 but the batch has only 40 documents"),
        (dict(keep="step"), "keep must be one of"),
        (dict(equal_counts="yes"), "equal_counts must be True or False"),
        (dict(overflow="drop"), "overflow must be one of"),
        # a group heavier than a rank can hold: 10 documents of 100 tokens, one rank holds 2 * 300
        (dict(groups=np.repeat(np.arange(4), 10)), r"has 1000 tokens, more than one DP rank holds"),
        (dict(groups=np.repeat(np.arange(20), 2), keep="micro_batch", micro_batches="auto"), None),
        (dict(groups=np.repeat(np.arange(10), 4), keep="micro_batch"), r"more than one micro-batch holds"),
    ],
)
def test_bad_input_one_clear_error(kwargs, match):
    lengths = np.full(40, 100)
    topo = balancer.Topology(dp=2, micro_batches=2, max_tokens=300)
    if match is None:  # a valid call next to the bad ones
        balancer.balance_batch(lengths, topo, COST, **kwargs).validate()
        return
    with pytest.raises(ValueError, match=match):
        balancer.balance_batch(lengths, topo, COST, **kwargs)


def test_bad_lengths_and_types():
    topo = balancer.Topology(dp=2)
    with pytest.raises(ValueError, match="lengths"):
        balancer.balance_batch([5, 0, 3], topo, COST)
    with pytest.raises(TypeError, match="topology"):
        balancer.balance_batch([5, 3], "dp2", COST)
    with pytest.raises(ValueError, match="document 1 has 9000 tokens"):
        balancer.balance_batch([5, 9000, 3, 4], balancer.Topology(dp=2, max_tokens=4096), COST)
    split = balancer.balance_batch(
        [5, 9000, 3, 4], balancer.Topology(dp=2, max_tokens=4096), COST, overflow="split", micro_batches="auto"
    )
    split.validate()
    assert split.dropped_tokens == 0 and len(split.doc) == 6


def test_plan_file_round_trip(tmp_path):
    lengths = np.random.default_rng(4).integers(10, 900, 48)
    topo = balancer.Topology(dp=2, cp=2, micro_batches=2, max_tokens=2048)
    plan = balancer.balance_batch(lengths, topo, COST, groups=np.repeat(np.arange(24), 2), mini_batches=3)
    for name in ("plan.json", "plan.npz"):
        plan.save(tmp_path / name)
        back = balancer.Plan.load(tmp_path / name)
        assert back.topology == plan.topology and back.num_steps == 3
        assert np.array_equal(back.doc, plan.doc) and np.array_equal(back.mb_ptr, plan.mb_ptr)
    assert balancer.distributed.balance_batch is not None  # reachable from the top level, lazily
