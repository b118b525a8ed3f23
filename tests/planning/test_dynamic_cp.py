"""Dynamic CP: topology validation, the partition invariants (hypothesis), the time model, the plan format and
views, the sampler and collator (DataLoader workers included)."""

from __future__ import annotations

import dataclasses
import json
import pickle

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import balancer
from balancer import CostModel, Plan, Topology
from balancer.planning.metrics import dynamic_step_times, step_times
from balancer.planning.plans.checks import check_partition

COST = CostModel(attn_coef=1.0, linear_coef=50.0)


def _lengths(n=240, seed=0, giants=(1500, 1100, 900)):
    lengths = np.random.default_rng(seed).integers(1, 300, n)
    lengths[: len(giants)] = giants
    return lengths


TOPO = Topology(dp=2, cp=2, micro_batches=3, max_tokens=512, cp_sizes=(1, 2, 4))


@pytest.fixture(scope="module")
def plan():
    return balancer.plan(_lengths(), TOPO, COST, seed=0)


# ---- topology -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "sizes, match",
    [((1, 0, 2), "size 0"), ((1, 3), "size 3 does not divide"), ((), "empty"), ((1.5,), "1.5"), ("12", "sequence")],
)
def test_cp_sizes_validation(sizes, match):
    with pytest.raises(ValueError, match=match):
        Topology(dp=2, cp=2, max_tokens=64, cp_sizes=sizes)


def test_document_too_large_for_every_group_is_named():
    lengths = _lengths()
    lengths[7] = 4 * 512 + 1
    with pytest.raises(ValueError, match=r"document 7 has 2049 tokens.*max\(cp_sizes\)\*max_tokens = 4\*512"):
        balancer.plan(lengths, TOPO, COST)
    with pytest.raises(ValueError, match="document 7"):
        balancer.BalancedBatchSampler(lengths, TOPO, COST, rank=0)
    split = balancer.plan(lengths, TOPO, COST, overflow="split")
    split.validate()


# ---- the partition invariants --------------------------------------------------------------------------------------
@pytest.mark.slow  # hypothesis: ~3 s
@settings(max_examples=25, deadline=None)
@given(
    dp=st.sampled_from([1, 2, 4]),
    cp=st.sampled_from([1, 2]),
    pp=st.sampled_from([1, 3]),
    m=st.integers(1, 3),
    pick=st.integers(1, 63),
    seed=st.integers(0, 10**6),
    n=st.integers(40, 160),
)
def test_partition_invariants(dp, cp, pp, m, pick, seed, n):
    pool = dp * cp
    divisors = [s for s in (1, 2, 4, 8) if pool % s == 0]
    sizes = tuple(s for i, s in enumerate(divisors) if pick >> i & 1) or (divisors[-1],)
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, min(200, 64 * max(sizes)) + 1, n)
    lengths[rng.integers(0, n)] = 64 * max(sizes)  # a giant that needs the largest group
    topo = Topology(dp=dp, cp=cp, pp=pp, micro_batches=m, max_tokens=64, cp_sizes=sizes)
    assume(n >= m * pool // max(sizes))  # enough documents for every group of a step
    p = balancer.plan(lengths, topo, COST, seed=seed % 7)
    p.validate()  # exactly once, non-empty groups within size * max_tokens, aligned partition of every slot
    check_partition(p.group_start, p.group_size, p.slot_ptr, topo)
    assert np.all(np.isin(p.group_size, sizes)) and np.all(p.group_start % p.group_size == 0)
    for k in range(len(p.slot_ptr) - 1):  # every rank busy in every slot
        a, b = p.slot_ptr[k], p.slot_ptr[k + 1]
        covered = np.concatenate([np.arange(s, s + z) for s, z in zip(p.group_start[a:b], p.group_size[a:b])])
        assert np.array_equal(covered, np.arange(pool))
    assert np.all(np.diff(p.mb_ptr) > 0)
    assert np.all(p.micro_batch_tokens() <= topo.max_tokens * p.group_size)
    again = balancer.plan(lengths, topo, COST, seed=seed % 7)  # deterministic
    assert all(np.array_equal(getattr(p, a), getattr(again, a)) for a in ("doc", "group_start", "slot_ptr"))
    assert p.metrics()["epoch_efficiency"] <= 1 + 1e-9


def test_giant_documents_get_large_groups_short_ones_single_ranks():
    topo = dataclasses.replace(TOPO, max_tokens=1024, tokens_per_step=None)
    lengths = _lengths(n=3000, seed=3, giants=(4091, 3072, 2048, 1536))
    p = balancer.plan(lengths, topo, COST, seed=1)
    size_of_doc = np.zeros(len(lengths), dtype=np.int64)
    size_of_doc[p.doc] = np.repeat(p.group_size, np.diff(p.mb_ptr))
    assert np.all(size_of_doc[:4] == 4)
    assert np.mean(size_of_doc[lengths < 50] == 1) > 0.6
    assert p.metrics()["epoch_efficiency"] > 0.99


# ---- time model and metrics ----------------------------------------------------------------------------------------
def test_time_model_waits_for_partners():
    topo = Topology(dp=2, cp=1, pp=2, micro_batches=2, max_tokens=100, cp_sizes=(1, 2))
    # slot 0: ranks 0 and 1 alone (costs 4 and 1); slot 1: one group of both (cost 6 -> 3 each)
    cost = np.array([4.0, 1.0, 6.0])
    t = dynamic_step_times(cost, np.array([0, 1, 0]), np.array([1, 1, 2]), np.array([0, 2, 3]), topo)
    # rank 1 waits for rank 0 (finish 4), slot 1 ends at 7; largest group time per rank: 4 and 3
    assert t.tolist() == [max(1 * 4 + 7, 1 * 3 + 7)]


def test_static_partition_gives_the_static_formula():
    lengths = _lengths(n=400, seed=5, giants=(1000, 900))
    static_topo = Topology(dp=2, cp=2, pp=3, micro_batches=3, max_tokens=512)
    sp = balancer.plan(lengths, static_topo, COST, seed=2)
    nb = static_topo.bins_per_step
    k = np.arange(len(sp.mb_ptr) - 1)
    replica, slot = (k % nb) // 3, (k // nb) * 3 + k % 3
    order = np.lexsort((replica, slot))  # slot-major, ranks ascending
    t = dynamic_step_times(sp.micro_batch_costs().ravel()[order], replica[order] * 2, np.full(len(k), 2),
                           np.arange(0, len(k) + 1, 2), static_topo)  # fmt: skip
    assert np.allclose(t, step_times(sp.micro_batch_costs(), static_topo), rtol=1e-12)


def test_metrics_use_the_dynamic_bound(plan):
    m = plan.metrics()
    w = plan.cost_model.cost(plan.lengths)
    lb = max(w.sum() / 4, w.max() / 4)  # P = 1, largest group 4
    assert m["lower_bound_epoch"] == pytest.approx(lb)
    assert m["epoch_efficiency"] == pytest.approx(lb / plan.step_times().sum())
    assert 0.98 < m["epoch_efficiency"] <= 1.0


# ---- format and views ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("suffix", [".json", ".npz"])
def test_round_trip_and_json_layout(plan, tmp_path, suffix):
    path = tmp_path / f"p{suffix}"
    plan.save(path)
    back = Plan.load(path)
    for name in ("doc", "start", "end", "mb_ptr", "group_start", "group_size", "slot_ptr"):
        assert np.array_equal(getattr(back, name), getattr(plan, name)), name
    assert back.topology == plan.topology and back.metrics()["steps"] == plan.num_steps
    if suffix == ".json":
        data = json.loads(path.read_text())
        assert data["topology"]["cp_sizes"] == [1, 2, 4]
        group = data["steps"][0]["slots"][0]["groups"][0]
        assert set(group) <= {"ranks", "docs", "spans"} and len(group["ranks"]) == 2
        assert len(data["steps"][0]["slots"]) == 3


def test_load_rejects_a_broken_partition(plan, tmp_path):
    path = tmp_path / "p.json"
    plan.save(path)
    data = json.loads(path.read_text())
    data["steps"][0]["slots"][0]["groups"][0]["ranks"] = [1, 2]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=str(path)):
        Plan.load(path)


def test_views(plan):
    with pytest.raises(AttributeError, match="dynamic CP"):
        print(plan.steps[0].replicas)
    with pytest.raises(ValueError, match="dynamic CP"):
        plan.rank_view(0)
    for rank in range(4):
        view = plan.pool_view(rank)
        assert len(view) == plan.num_steps and all(len(s) == 3 for s in view)
        for step, slots in enumerate(view):
            for k, (key, docs) in enumerate(slots):
                group = next(g for g in plan.steps[step].slots[k].groups if g.key == key)
                assert key[0] <= rank < key[0] + key[1] and group.ids == docs
    static = balancer.plan(_lengths(giants=(1000,)), dataclasses.replace(TOPO, cp_sizes=None), COST)
    with pytest.raises(ValueError, match="dynamic-CP view"):
        static.pool_view(0)


# ---- sampler and collator ------------------------------------------------------------------------------------------
def test_sampler_ranks_agree_and_cover_every_document(plan):
    lengths = _lengths()
    samplers = [balancer.BalancedBatchSampler(lengths, TOPO, COST, rank=r, seed=0) for r in range(4)]
    got = {r: list(s) for r, s in enumerate(samplers)}
    assert len({len(b) for b in got.values()}) == 1
    seen = []
    for i in range(len(got[0])):
        by_group = {}
        for r in range(4):
            group = {x.group for x in got[r][i]}
            assert len(group) == 1
            g = group.pop()
            assert g.start + g.rank == r
            by_group.setdefault(g.key, []).append([int(x) for x in got[r][i]])
        for key, lists in by_group.items():
            assert len(lists) == key[1] and all(x == lists[0] for x in lists)  # the whole group yields the same
            seen += lists[0]
    assert sorted(seen) == list(range(len(lengths)))


def test_sampler_resumes_mid_epoch():
    lengths = _lengths()
    s = balancer.BalancedBatchSampler(lengths, TOPO, COST, rank=3, seed=0)
    full = [[(int(x), x.group) for x in b] for b in s]
    it = iter(s)
    for _ in range(4):
        next(it)
    state = json.loads(json.dumps(s.state_dict()))
    t = balancer.BalancedBatchSampler(lengths, TOPO, COST, rank=3, seed=0)
    t.load_state_dict(state)
    assert [[(int(x), x.group) for x in b] for b in t] == full[4:]


def test_indices_pickle_and_need_a_rank():
    from balancer.training import CPGroup, Member, Span

    g = CPGroup(2, 2, 1)
    for idx in (Member(5, g), Span(5, 0, 3, g)):
        back = pickle.loads(pickle.dumps(idx))
        assert back == idx and back.group == g
    with pytest.raises(ValueError, match="rank="):
        balancer.BalancedBatchSampler(_lengths(), TOPO, COST, seed=0)


@pytest.mark.parametrize("workers", [0, 2])
def test_collated_batches_carry_their_group(workers):
    lengths = _lengths(n=120)
    data = [{"input_ids": torch.arange(int(n)) % 97} for n in lengths]
    sampler = balancer.BalancedBatchSampler(lengths, TOPO, COST, rank=1, seed=0, dataset=data)
    loader = torch.utils.data.DataLoader(
        balancer.SpanDataset(data),
        batch_sampler=sampler,
        collate_fn=balancer.PackedCollator(),
        num_workers=workers,
    )
    for i, batch in enumerate(loader):
        group = sampler.cp_group(*sampler.step_of(i))
        assert batch["cp_group_key"] == group.key and batch["cp_rank"] == group.rank == 1 - group.start
        assert batch["cp_size"] == group.size == batch["layout"].cp_size
        assert batch["num_tokens"] == sum(int(lengths[int(x)]) for x in sampler.micro_batch(*sampler.step_of(i)))


def test_static_batches_carry_their_group():
    collate = balancer.PackedCollator(cp_rank=1, cp_size=2, dp_rank=3)
    batch = collate([{"input_ids": torch.arange(10)}])
    assert (batch["cp_rank"], batch["cp_size"], batch["cp_group_key"]) == (1, 2, (6, 2))
    with pytest.raises(ValueError, match="different CP groups"):
        balancer.PackedCollator()(
            [
                {"input_ids": torch.arange(4), "cp_group": (0, 2, 0)},
                {"input_ids": torch.arange(4), "cp_group": (2, 2, 0)},
            ]
        )


# ---- command line --------------------------------------------------------------------------------------------------
def test_cli_plan_cp_sizes(tmp_path, capsys):
    from balancer.cli import main

    src = tmp_path / "lengths.json"
    src.write_text(json.dumps(_lengths(n=400).tolist()))
    out = tmp_path / "plan.json"
    base = [str(src), "--dp", "2", "--cp", "2", "--micro-batches", "2", "--max-tokens", "512", "-q"]
    assert main(["plan", *base, "--cp-sizes", "1,2,4", "-o", str(out)]) == 0
    table = capsys.readouterr().out
    assert "balancer (dynamic CP)" in table and "balancer (static CP)" not in table  # giants do not fit cp=2
    plan = Plan.load(out)
    assert plan.topology.cp_sizes == (1, 2, 4) and plan.dynamic
    for bad, match in (("1,3", "--cp-sizes: size 3 does not divide"), ("1,x", "comma-separated"), ("0,4", "size 0")):
        assert main(["plan", *base, "--cp-sizes", bad, "-o", str(out)]) == 2
        assert match in capsys.readouterr().err


def test_communication_aware_cuts_and_prediction():
    comm = CostModel.from_model(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, hardware="h100-ib")
    lengths = _lengths(n=300, seed=4, giants=(1800, 1500))
    static = balancer.plan(lengths, dataclasses.replace(TOPO, cp_sizes=None, max_tokens=1024), comm, seed=0)
    p = balancer.plan(lengths, dataclasses.replace(TOPO, max_tokens=1024), comm, seed=0)
    p.validate()
    size_of_doc = np.zeros(len(lengths), dtype=np.int64)
    size_of_doc[p.doc] = np.repeat(p.group_size, np.diff(p.mb_ptr))
    assert np.mean(size_of_doc[lengths < 100] == 1) > 0.8  # short documents pay no K/V traffic
    pred, pred_static = p.predict(), static.predict()
    assert len(pred["step_times"]) == p.num_steps
    assert pred["step_time_total"] < pred_static["step_time_total"]


@settings(max_examples=40, deadline=None)
@given(
    st.integers(0, 10_000),
    st.sampled_from([1, 2, 3, 4, 8]),
    st.sampled_from([None, 64]),
    st.booleans(),
)
def test_batched_prediction_equals_one_by_one(seed, cp, window, causal):
    """`micro_batch_times` (what the communication-aware dynamic planner evaluates a whole plan with) gives exactly
    `micro_batch_time` of every micro-batch: zigzag layout, ring attention, windows and bidirectional models."""
    from balancer.planning.cost.predict import micro_batch_time, micro_batch_times

    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 3000, int(rng.integers(1, 200)))
    cuts = np.unique(rng.integers(1, len(lengths) + 1, int(rng.integers(0, 12))))
    ptr = np.unique(np.concatenate([[0], cuts, [len(lengths)]]))
    cost = balancer.CostModel(
        attn_coef=1e-4, linear_coef=1.0, piece_coef=3.0, comm_coef=0.5, comm_latency=7.0, causal=causal, window=window
    )
    batched = micro_batch_times(cost, lengths, ptr, cp)
    single = [micro_batch_time(cost, lengths[a:b], cp) for a, b in zip(ptr[:-1], ptr[1:])]
    np.testing.assert_allclose(batched, single, rtol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
def test_zigzag_sums_equal_the_layout_prediction(causal):
    """The closed-form group times (balancer.planning.dynamic.group_times) equal predict.micro_batch_time exactly."""
    from balancer.planning.cost.predict import micro_batch_time
    from balancer.planning.dynamic.group_times import zigzag_sums

    cost = CostModel(
        attn_coef=3e-9, linear_coef=7e-5, piece_coef=2e-5, comm_coef=1e-5, comm_latency=2e-3, causal=causal
    )
    rng = np.random.default_rng(5)
    for cp in (2, 4, 8):
        lengths = np.concatenate([rng.integers(1, 4 * cp, 40), rng.integers(1, 300_000, 40)])
        group = np.sort(rng.integers(0, 12, len(lengths)))
        ptr = np.searchsorted(group, np.arange(13))
        assert np.all(np.diff(ptr) > 0)
        times = zigzag_sums(cost, cp)(lengths, group, 12)
        expected = [micro_batch_time(cost, lengths[ptr[g] : ptr[g + 1]], cp) for g in range(12)]
        assert times.tolist() == expected
    assert zigzag_sums(CostModel(attn_coef=1e-9, linear_coef=1e-5, comm_coef=1e-5, window=64), 4) is None


def test_batched_deal_is_largest_first():
    """cuts.deal gives every node the LPT deal (largest first, stable, to the least-loaded part, ties to the lowest)."""
    import heapq

    from balancer.planning.dynamic.cuts import deal

    rng = np.random.default_rng(2)
    counts = rng.integers(1, 30, 25)
    ptr = np.concatenate([[0], np.cumsum(counts)])
    costs = rng.integers(1, 6, ptr[-1]).astype(float)  # many ties
    got = deal(costs, ptr, 3)
    for i in range(len(counts)):
        values = costs[ptr[i] : ptr[i + 1]].tolist()
        heap, want = [(0.0, p) for p in range(3)], [0] * len(values)
        for j in sorted(range(len(values)), key=values.__getitem__, reverse=True):
            load, p = heapq.heappop(heap)
            want[j] = p
            heapq.heappush(heap, (load + values[j], p))
        assert got[ptr[i] : ptr[i + 1]].tolist() == want
