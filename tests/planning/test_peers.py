"""The peers of benchmarks/compare.py: each yields a valid balancer.Plan (or reports its drops), the TRL mapping
recovers every document exactly once, and Karmarkar-Karp is right on hand examples."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import balancer  # noqa: E402
from balancer.data.traces import heavy_tail, sft_mix  # noqa: E402

peers = pytest.importorskip("peers")

COST = balancer.CostModel(attn_coef=2 / 53000, linear_coef=1.0)


def _topo(lengths, dp, cp=1, pp=1, m=2):
    max_tokens = 1 << int(np.ceil(np.log2(-(-int(lengths.max()) // cp))))
    return balancer.Topology(dp=dp, cp=cp, pp=pp, micro_batches=m, max_tokens=max_tokens)


@pytest.fixture(scope="module")
def lengths():
    rng = np.random.default_rng(3)
    x = heavy_tail(600, seed=3, lo=16384, hi=65536)
    x[rng.choice(len(x), 5, replace=False)] = rng.integers(20000, 60000, 5)
    return x


TOPOS = [dict(dp=4, m=2), dict(dp=2, cp=4, m=4), dict(dp=2, cp=2, pp=2, m=4)]


@pytest.mark.parametrize("name", ["multipack", "verl", "wlb", "balancer"])
@pytest.mark.parametrize("spec", TOPOS, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_peer_plans_are_valid(name, spec, lengths):
    topo = _topo(lengths, **spec)
    plan = peers.PEERS[name](lengths, topo, COST, seed=1)
    plan.validate()
    m = plan.metrics()
    assert m["dropped_tokens"] == 0
    assert m["imbalance"] >= 1.0 - 1e-9 and 0 < m["epoch_efficiency"] <= 1.0 + 1e-9
    assert plan.plan_seconds > 0
    # same seeded shuffle as the toolkit: natural_step is that of balancer.planning.metrics.natural_steps
    order = np.random.default_rng(1).permutation(len(lengths))
    if name != "balancer":
        assert np.array_equal(
            plan.natural_step, balancer.planning.metrics.natural_steps(order, lengths, topo.tokens_per_step)
        )


@pytest.mark.parametrize("name", ["multipack", "verl"])
def test_step_peers_handle_a_tight_fill(name):
    # documents up to the cap at 85% fill: FFD / KK cannot always fit a step, so documents are deferred
    lengths = sft_mix(1500, seed=2)
    topo = balancer.Topology(dp=4, micro_batches=4, max_tokens=4096)
    plan = peers.PEERS[name](lengths, topo, COST, seed=0)
    plan.validate()
    assert plan.metrics()["dropped_tokens"] == 0


@pytest.fixture(scope="module")
def packed(lengths):
    pytest.importorskip("trl")
    order = peers.shuffled_order(len(lengths), 1)
    return order, peers.trl_pack(lengths, 1 << int(np.ceil(np.log2(lengths.max()))), order)


def test_trl_mapping_recovers_every_document_once(lengths, packed):
    order, (rows, seconds, placed) = packed
    seq = 1 << int(np.ceil(np.log2(lengths.max())))
    docs = np.concatenate(rows)
    assert np.array_equal(np.sort(docs), np.arange(len(lengths)))  # each document exactly once
    assert np.array_equal(placed, lengths)  # nothing truncated
    assert all(lengths[r].sum() <= seq for r in rows)
    assert seconds > 0


def test_trl_mapping_matches_pack_dataset_on_a_hand_example():
    pytest.importorskip("trl")
    lengths = np.array([5, 2, 3, 1])
    rows, _, placed = peers.trl_pack(lengths, 4)
    # the docstring example of trl.pack_dataset: BFD truncates the 5-token row to 4 and packs [4], [3, 1], [2]
    assert [r.tolist() for r in rows] == [[0], [2, 3], [1]]
    assert placed.tolist() == [4, 2, 3, 1]


@pytest.mark.parametrize("spec", TOPOS, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_trl_plan_is_valid_and_deals_rows_round_robin(spec, lengths, packed):
    order, pk = packed
    topo = _topo(lengths, **spec)
    if topo.micro_batch_tokens != 1 << int(np.ceil(np.log2(lengths.max()))):
        pk = None
    plan = peers.trl_plan(lengths, topo, COST, seed=1, packed=pk)
    plan.validate()
    assert plan.metrics()["dropped_tokens"] == 0
    rows = pk[0] if pk is not None else None
    if rows is not None:
        import torch

        perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(1)).numpy()
        nb, dp = topo.bins_per_step, topo.dp
        first = plan.step(0)
        for i in range(nb):  # row i of step 0 -> rank i % dp, micro-batch i // dp
            assert first.replicas[i % dp].micro_batches[i // dp].docs == rows[perm[i]].tolist()


def test_trl_drop_tail_counts_dropped_tokens(lengths, packed):
    _, pk = packed
    topo = _topo(lengths, dp=4, m=2)
    plan = peers.trl_plan(lengths, topo, COST, seed=1, packed=pk, tail="drop")
    rest = len(pk[0]) % topo.bins_per_step
    m = plan.metrics()
    if rest:
        assert m["dropped_tokens"] > 0 and "dropped" in plan.peer_notes["tail"]
        with pytest.raises(ValueError, match="not in the plan"):
            plan.validate()
    assert m["dropped_tokens"] == lengths.sum() - plan.micro_batch_tokens().sum()


def test_karmarkar_karp_hand_examples():
    # textbook: KK on {4,5,6,7,8} gives 16 / 14 ({8,6} vs {7,5,4}), not the optimum 15 / 15
    parts = peers.karmarkar_karp([4, 5, 6, 7, 8], 2)
    sums = sorted(sum([4, 5, 6, 7, 8][i] for i in p) for p in parts)
    assert sums == [14, 16]
    assert sorted(map(sorted, parts)) == [[0, 1, 3], [2, 4]]
    # a perfect 3-way split exists and KK finds it: {9,6}, {8,7}, {10,5}
    w = [10, 9, 8, 7, 6, 5]
    parts = peers.karmarkar_karp(w, 3)
    assert sorted(sum(w[i] for i in p) for p in parts) == [15, 15, 15]
    # equal_size: every part gets len/k items
    parts = peers.karmarkar_karp([1, 2, 3, 4, 5, 6, 7, 8], 4, equal_size=True)
    assert all(len(p) == 2 for p in parts)
    assert sorted(sum([1, 2, 3, 4, 5, 6, 7, 8][i] for i in p) for p in parts) == [9, 9, 9, 9]


def test_karmarkar_karp_partitions_every_item_once():
    rng = np.random.default_rng(0)
    w = rng.integers(1, 1000, 257)
    for k in (1, 2, 5, 16):
        parts = peers.karmarkar_karp(w, k)
        assert len(parts) == k
        assert sorted(i for p in parts for i in p) == list(range(len(w)))
        sums = [w[p].sum() for p in parts]
        assert max(sums) - min(sums) <= w.max()


def test_verl_workload_is_verls():
    assert peers.verl_workload([1000]).tolist() == [24576 * 1000 + 1000**2]


def test_trl_short_tail_is_dealt_with_the_step_before():
    pytest.importorskip("trl")
    lengths = sft_mix(2995, seed=0)
    topo = balancer.Topology(dp=8, micro_batches=4, max_tokens=4096)
    plan = peers.trl_plan(lengths, topo, COST, seed=0)
    plan.validate()
    assert plan.metrics()["dropped_tokens"] == 0
    assert "dealt over 2 steps" in plan.peer_notes["tail"]


# ---- the package peers (benchmarks/peers_pkg.py) and the trainer benchmark's attention --------------------------

peers_pkg = pytest.importorskip("peers_pkg")


def _step_sets(plan):
    return [sorted(d for rep in st.replicas for mb in rep.micro_batches for d in mb.docs) for st in plan.steps]


@pytest.mark.parametrize("m", [2, 4])
def test_count_based_peers_cover_every_document_once_on_the_same_slices(m, lengths):
    pytest.importorskip("transformers")
    topo = _topo(lengths, dp=4, m=m)
    steps = 5
    hf = peers_pkg.hf_rebalance_plan(lengths, topo, COST, seed=1, steps=steps)
    mine = peers_pkg.balancer_slices_plan(lengths, topo, COST, seed=1, steps=steps)
    for plan in (hf, mine):
        plan.validate()  # every token exactly once, dp x M non-empty micro-batches per step
        assert plan.metrics()["dropped_tokens"] == 0
    assert _step_sets(hf) == _step_sets(mine)  # the project is scored on the peer's own global batches
    b = hf.peer_notes["docs_per_step"]
    order = peers_pkg.hf_order(len(lengths), 1)
    assert _step_sets(hf)[0] == sorted(order[:b].tolist())  # BatchRebalanceSampler's own shuffle
    assert mine.metrics()["imbalance"] <= hf.metrics()["imbalance"] + 1e-9


@pytest.mark.slow  # importing verl takes seconds
def test_verl_package_peer_is_valid_and_uses_the_same_slices(lengths):
    pytest.importorskip("verl.utils.seqlen_balancing")
    topo = _topo(lengths, dp=4, m=2)
    plan = peers_pkg.verl_pkg_plan(lengths, topo, COST, seed=1, steps=5)
    plan.validate()
    assert plan.metrics()["dropped_tokens"] == 0
    mine = peers_pkg.balancer_slices_plan(lengths, topo, COST, seed=1, steps=5)
    assert _step_sets(plan) == _step_sets(mine)


def test_docs_per_step_never_leaves_a_tail_the_sampler_would_pad():
    topo = balancer.Topology(dp=4, micro_batches=4, max_tokens=1024)
    for n in (64, 100, 333, 1000, 4097):
        for steps in (1, 3, 7, 20):
            b = peers_pkg.docs_per_step(n, topo, steps)
            assert b % 4 == 0 and b >= 16 and (n % b == 0 or n % b >= 16)


def test_score_row_excess_and_ratio():
    def rec(eff, imb):
        return dict(status="ok", epoch_efficiency=eff, imbalance=imb, step_time_total=imb * 100.0,
                    lower_bound_epoch=eff * imb * 100.0, dropped_tokens=0)  # fmt: skip

    row = dict(peers=dict(trl=rec(0.8, 1.2), hf_rebalance=rec(0.9, 1.1), verl_pkg={"status": "failed: x"},
                          balancer_slices=rec(0.95, 1.0), balancer=rec(1 / 1.05, 1.01)))  # fmt: skip
    peers_pkg.score_row(row)
    assert row["best_peer"] == "hf_rebalance"
    assert row["peers"]["balancer"]["excess_epoch"] == pytest.approx(0.05)
    assert row["ratio"] == pytest.approx(0.05 / (1 / 0.9 - 1))
    assert row["slices_ratio"] == pytest.approx((1 / 0.95 - 1) / (1 / 0.9 - 1))
    assert row["peers"]["verl_pkg"]["excess_epoch"] is None and row["goal_met"]  # 45% <= 50%


@pytest.mark.parametrize("layout", ["padded", "cu_seq_lens", "position_ids"])
def test_flat_varlen_attention_is_per_document_causal_attention(layout):
    pytest.importorskip("transformers")
    import torch

    worker = pytest.importorskip("_trainer_worker")
    torch.manual_seed(0)
    docs = [[5, 3], [7]] if layout == "padded" else [[5, 3, 4]]
    rows, t = len(docs), max(sum(d) for d in docs)
    q, k, v = torch.randn(rows, 4, t, 8), torch.randn(rows, 2, t, 8), torch.randn(rows, 2, t, 8)
    kwargs, mask = {}, None
    if layout == "padded":
        docs = [[5], [7]]
        mask = (torch.arange(t)[None] < torch.tensor([5, 7])[:, None]).long()
    elif layout == "cu_seq_lens":
        kwargs["cu_seq_lens_q"] = torch.tensor([0, 5, 8, 12], dtype=torch.int32)
    else:
        kwargs["position_ids"] = torch.cat([torch.arange(n) for n in (5, 3, 4)])[None]
    out, _ = worker.flat_varlen_attention(None, q, k, v, mask, scaling=None, **kwargs)
    for r, lens in enumerate(docs):
        s = 0
        for n in lens:  # reference: plain causal softmax attention inside each document, K/V heads repeated
            qs, ks, vs = q[r, :, s : s + n], k[r, :, s : s + n].repeat_interleave(2, 0), v[r, :, s : s + n]
            ref = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs.repeat_interleave(2, 0), is_causal=True)
            assert torch.allclose(out[r, s : s + n], ref.transpose(0, 1), atol=2e-5, rtol=0)
            s += n
        assert not out[r, s:].any()  # padded positions: zeros
