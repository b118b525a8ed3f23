"""Uneven ranks in the planners (`Topology(rank_speeds=...)`): work in proportion to speed on the static,
pipeline and dynamic-CP paths and in `balance_batch`; equal speeds plan exactly what even ranks plan; the step
count does not depend on the speeds; every token still placed exactly once."""

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import balancer
from balancer import CostModel, Plan, Topology
from balancer.data.traces import load_trace
from balancer.planning.packing import pack_step

COST = CostModel(attn_coef=2 / 53000, linear_coef=1.0)
FLOPS = CostModel.from_model(
    hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, intermediate_size=14336, vocab_size=128256
)


def _placements(plan: Plan):
    groups = () if not plan.dynamic else (plan.group_start, plan.group_size, plan.slot_ptr)
    return (plan.doc, plan.start, plan.end, plan.mb_ptr, *groups)


def _same(a: Plan, b: Plan) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(_placements(a), _placements(b)))


def _with(topology: Topology, speeds) -> Topology:
    return dataclasses.replace(topology, rank_speeds=None if speeds is None else tuple(speeds))


def _blind(plan: Plan, speeds) -> Plan:
    """`plan`'s placements scored on ranks of `speeds` (what a speed-blind plan runs like on uneven ranks)."""
    groups = None if not plan.dynamic else (plan.group_start, plan.group_size, plan.slot_ptr)
    topo = _with(plan.topology, speeds)
    return Plan(plan.lengths, topo, plan.cost_model, plan.doc, plan.start, plan.end, plan.mb_ptr, groups=groups)


def replica_work(plan: Plan) -> np.ndarray:
    """Each replica's predicted work over the epoch (cost units, per CP rank)."""
    return plan.micro_batch_costs().sum(axis=(0, 2)) / plan.topology.cp


def pool_work(plan: Plan) -> np.ndarray:
    """Dynamic CP: each pool rank's predicted work (a group's cost shared by its ranks)."""
    cost = plan.micro_batch_costs() / plan.group_size
    per = np.zeros(plan.topology.pool_size + 1)
    np.add.at(per, plan.group_start, cost)
    np.add.at(per, plan.group_start + plan.group_size, -cost)
    return np.cumsum(per)[:-1]


@st.composite
def instances(draw, max_docs=250, dynamic=False):
    dp = draw(st.integers(1, 4))
    cp = draw(st.sampled_from([1, 2]))
    pp = draw(st.integers(1, 3))
    m = draw(st.integers(1, 3))
    n = draw(st.integers(dp * cp * m, max_docs))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    kind = draw(st.sampled_from(["uniform", "heavy", "tiny"]))
    if kind == "uniform":
        lengths = rng.integers(1, 3000, n)
    elif kind == "tiny":
        lengths = rng.integers(1, 4, n)
    else:
        lengths = np.minimum((rng.pareto(1.1, n) + 1) * 200, 60000).astype(np.int64)
    max_tokens = int(-(-lengths.max() // cp) * draw(st.sampled_from([1.0, 1.3, 2.0])))
    cap = dp * cp * m * max_tokens
    sizes = tuple(s for s in (1, 2, 4, 8) if (dp * cp) % s == 0) if dynamic else None
    topo = Topology(
        dp=dp,
        cp=cp,
        pp=pp,
        micro_batches=m,
        max_tokens=max_tokens,
        tokens_per_step=max(1, int(draw(st.floats(0.3, 1.0)) * cap)),
        cp_sizes=sizes,
    )
    ranks = dp * cp if dynamic else dp
    speeds = draw(st.lists(st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0]), min_size=ranks, max_size=ranks))
    return lengths, topo, speeds, draw(st.integers(0, 1000))


def _plan_or_none(lengths, topo, cost, seed):
    try:
        return balancer.plan(lengths, topo, cost, seed=seed, overflow="split")
    except ValueError:  # an instance the even planner refuses too (checked by the caller)
        return None


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances(), st.sampled_from([1.0, 2.0, 0.75]))
def test_equal_speeds_plan_exactly_the_even_plan(inst, speed):
    lengths, topo, _, seed = inst
    even = _plan_or_none(lengths, topo, COST, seed)
    same = _plan_or_none(lengths, _with(topo, [speed] * topo.dp), COST, seed)
    assert (even is None) == (same is None)
    if even is not None:
        assert _same(even, same)
        if speed == 1.0:
            metrics = same.metrics()
            assert {k: v for k, v in metrics.items() if k not in ("rank_speeds", "plan_seconds")} == {
                k: v for k, v in even.metrics().items() if k != "plan_seconds"
            }


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances(max_docs=160, dynamic=True), st.sampled_from([1.0, 2.0]))
def test_equal_speeds_plan_exactly_the_even_plan_dynamic(inst, speed):
    lengths, topo, _, seed = inst
    even = _plan_or_none(lengths, topo, COST, seed)
    same = _plan_or_none(lengths, _with(topo, [speed] * topo.pool_size), COST, seed)
    assert (even is None) == (same is None)
    if even is not None:
        assert _same(even, same)


def _check_step_counts(uneven: Plan, other: Plan, even: Plan) -> None:
    """Uneven plans of the same documents have the even plan's step count whatever their speeds (speed-aware
    packing of the last step must not open an overflow step for some speeds and not for others)."""
    assert uneven.num_steps == other.num_steps == even.num_steps


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances(), st.integers(0, 2**31 - 1))
def test_uneven_plans_place_every_token_once_and_the_step_count_ignores_speeds(inst, draw_seed):
    lengths, topo, speeds, seed = inst
    even = _plan_or_none(lengths, topo, COST, seed)
    uneven = _plan_or_none(lengths, _with(topo, speeds), COST, seed)
    assert (even is None) == (uneven is None)
    if even is not None:
        uneven.validate()  # every token exactly once, caps, M non-empty micro-batches per replica
        assert uneven.topology.rank_speeds == tuple(speeds)
        others = np.random.default_rng(draw_seed).permutation([0.5, 1.0, 2.0, 4.0] * topo.dp)[: topo.dp]
        if len(set(others)) == 1:
            others[0] = 3.0
        other = balancer.plan(lengths, _with(topo, others), COST, seed=seed, overflow="split")
        other.validate()
        if len(set(speeds)) > 1:  # equal speeds plan the even plan (the test above)
            _check_step_counts(uneven, other, even)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances(max_docs=160, dynamic=True))
def test_uneven_dynamic_plans_place_every_token_once(inst):
    lengths, topo, speeds, seed = inst
    even = _plan_or_none(lengths, topo, COST, seed)
    uneven = _plan_or_none(lengths, _with(topo, speeds), COST, seed)
    assert (even is None) == (uneven is None)
    if even is not None:
        uneven.validate()
        other = balancer.plan(lengths, _with(topo, list(reversed(speeds))), COST, seed=seed, overflow="split")
        other.validate()
        if len(set(speeds)) > 1:
            _check_step_counts(uneven, other, even)


def _sft(n: int, seed: int = 1, median: float = 700.0, top: int = 4096) -> np.ndarray:
    return np.clip(np.random.default_rng(seed).lognormal(np.log(median), 0.8, n), 32, top).astype(np.int64)


@pytest.mark.parametrize("pp, m, step_tokens", [(1, 4, 60_000), (4, 8, 80_000)])
@pytest.mark.parametrize("speeds", [(1.0, 1.0, 1.0, 2.0), (0.5, 1.0, 1.5, 2.0)])
def test_static_replicas_get_work_in_proportion_to_speed(pp, m, step_tokens, speeds):
    lengths = _sft(6000)
    # room: the fastest replica must hold 40% of a step's tokens on 25% of the memory
    topo = Topology(dp=4, cp=2, pp=pp, micro_batches=m, max_tokens=4096, tokens_per_step=step_tokens)
    plan = balancer.plan(lengths, _with(topo, speeds), FLOPS, seed=0)
    plan.validate()
    share = replica_work(plan) / replica_work(plan).sum()
    assert np.allclose(share, np.array(speeds) / sum(speeds), atol=0.01), share
    even = balancer.plan(lengths, topo, FLOPS, seed=0)
    assert plan.num_steps == even.num_steps
    aware, blind = plan.metrics()["epoch_efficiency"], _blind(even, speeds).metrics()["epoch_efficiency"]
    assert aware > 0.97 and aware > blind + 0.15, (aware, blind)


def test_heavy_documents_go_to_the_fast_replica():
    lengths = load_trace("wlbllm", n=4000, seed=3)
    topo = Topology(dp=4, cp=2, micro_batches=2, max_tokens=65536, tokens_per_step=300_000)
    speeds = (1.0, 1.0, 1.0, 3.0)
    plan = balancer.plan(lengths, _with(topo, speeds), FLOPS, seed=0)
    plan.validate()
    share = replica_work(plan) / replica_work(plan).sum()
    assert share[3] > 0.45 and np.all(share[:3] < 0.19), share
    blind = _blind(balancer.plan(lengths, topo, FLOPS, seed=0), speeds).metrics()["epoch_efficiency"]
    assert plan.metrics()["epoch_efficiency"] > blind + 0.2


def test_dynamic_pool_ranks_get_work_in_proportion_to_speed():
    lengths = _sft(6000, median=2000, top=16384)
    topo = Topology(dp=4, cp=2, micro_batches=4, max_tokens=8192, tokens_per_step=120_000, cp_sizes=(1, 2, 4))
    speeds = (1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0)  # the second half of the pool twice as fast
    plan = balancer.plan(lengths, _with(topo, speeds), FLOPS, seed=0)
    plan.validate()
    share = pool_work(plan) / pool_work(plan).sum()
    assert np.allclose(share, np.array(speeds) / sum(speeds), atol=0.01), share
    blind = _blind(balancer.plan(lengths, topo, FLOPS, seed=0), speeds).metrics()["epoch_efficiency"]
    assert plan.metrics()["epoch_efficiency"] > 0.97 and blind < 0.7


def test_a_group_runs_at_its_slowest_member():
    """A pool whose every CP group of the balancing size mixes a slow and a fast rank cannot run faster than the
    slow ranks where documents need whole groups: the plan is valid and no slower than the speed-blind one."""
    lengths = _sft(3000, median=2000, top=16384)
    topo = Topology(dp=4, cp=2, micro_batches=4, max_tokens=8192, tokens_per_step=120_000, cp_sizes=(1, 2, 4))
    speeds = (1.0, 1.0, 2.0, 2.0, 1.0, 1.0, 2.0, 2.0)
    plan = balancer.plan(lengths, _with(topo, speeds), FLOPS, seed=0)
    plan.validate()
    blind = _blind(balancer.plan(lengths, topo, FLOPS, seed=0), speeds)
    assert plan.metrics()["step_time_total"] <= blind.metrics()["step_time_total"]


@pytest.mark.parametrize(
    "options",
    [{}, {"equal_counts": True}, {"mini_batches": 2}, {"groups": "pairs"}, {"groups": "pairs", "keep": "micro_batch"}],
)
@pytest.mark.parametrize("pp", [1, 2])
def test_balance_batch_gives_ranks_work_in_proportion_to_speed(options, pp):
    lengths = _sft(512, seed=3, median=1500, top=16384)
    if options.get("groups") == "pairs":
        options = {**options, "groups": np.repeat(np.arange(256), 2)}
    topo = Topology(dp=4, pp=pp, micro_batches=4, max_tokens=262144)
    speeds = (0.5, 1.0, 1.5, 2.0)
    plan = balancer.balance_batch(lengths, _with(topo, speeds), FLOPS, seed=0, **options)
    plan.validate()
    share = replica_work(plan) / replica_work(plan).sum()
    assert np.allclose(share, np.array(speeds) / sum(speeds), atol=0.01), share
    assert plan.metrics()["imbalance"] < 1.03
    even = balancer.balance_batch(lengths, topo, FLOPS, seed=0, **options)
    assert _same(even, balancer.balance_batch(lengths, _with(topo, [1.0] * 4), FLOPS, seed=0, **options))


def test_balance_batch_dynamic_with_speeds():
    lengths = _sft(512, seed=4, median=1500, top=16384)
    topo = Topology(dp=2, cp=2, micro_batches=2, max_tokens=262144, cp_sizes=(1, 2, 4))
    plan = balancer.balance_batch(lengths, _with(topo, (1, 1, 2, 2)), FLOPS, seed=0)
    plan.validate()
    share = pool_work(plan) / pool_work(plan).sum()
    assert np.allclose(share, [1 / 6, 1 / 6, 1 / 3, 1 / 3], atol=0.01), share
    even = balancer.balance_batch(lengths, topo, FLOPS, seed=0)
    assert _same(even, balancer.balance_batch(lengths, _with(topo, [1.0] * 4), FLOPS, seed=0))


def test_pack_step_with_speeds():
    cost = FLOPS.cost(_sft(400, seed=5))
    tokens = _sft(400, seed=5)
    topo = Topology(dp=4, micro_batches=2, max_tokens=1 << 20, rank_speeds=(1.0, 2.0, 3.0, 4.0))
    unit_bin = pack_step(cost, tokens, topo)
    work = np.bincount(unit_bin // 2, weights=cost, minlength=4)
    assert np.allclose(work / work.sum(), [0.1, 0.2, 0.3, 0.4], atol=0.005), work / work.sum()
