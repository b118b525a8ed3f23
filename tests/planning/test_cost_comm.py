"""Cost model terms beyond section 3: windows, per-piece overhead, communication, presets, fit, save/load, predict."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attention
import balancer
from attention.geometry import attention_pairs, block_pairs
from balancer import CostModel, Topology
from balancer.planning.cost.microbatch import micro_batch_terms, rank_times
from balancer.planning.cost.model import HARDWARE
from balancer.planning.cost.predict import micro_batch_time


def brute_pairs(q_lo, q_hi, k_lo, k_hi, causal, window):
    i = np.arange(q_lo, q_hi)[:, None]
    j = np.arange(k_lo, k_hi)[None, :]
    w = np.inf if window is None else window
    ok = (i - j >= 0) & (i - j < w) if causal else np.abs(i - j) < w
    return int(ok.sum())


@settings(max_examples=150, deadline=None)
@given(
    st.integers(0, 40),
    st.integers(0, 40),
    st.integers(0, 40),
    st.integers(0, 40),
    st.booleans(),
    st.one_of(st.none(), st.integers(1, 30)),
)
def test_block_pairs_matches_brute_force(a, b, c, d, causal, window):
    q_lo, q_hi, k_lo, k_hi = min(a, b), max(a, b), min(c, d), max(c, d)
    got = block_pairs(q_lo, q_hi, k_lo, k_hi, causal, window)
    assert got == brute_pairs(q_lo, q_hi, k_lo, k_hi, causal, window)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [None, 1, 7, 64])
def test_windowed_pairs_formula(causal, window):
    d = np.array([1, 5, 7, 8, 63, 64, 65, 200])
    want = [brute_pairs(0, n, 0, n, causal, window) for n in d]
    assert attention_pairs(d, causal, window).tolist() == want
    if window is not None and causal:  # a long document's pairs are about d*w
        assert attention_pairs(10_000, True, window) == pytest.approx(10_000 * window, rel=0.01)


def test_window_reaches_the_planner():
    lengths = np.array([4096] * 8 + [64] * 64)
    full = CostModel(attn_coef=1.0, linear_coef=100.0)
    windowed = CostModel(attn_coef=1.0, linear_coef=100.0, window=256)
    assert windowed.cost(4096) == pytest.approx(256 * 257 / 2 + (4096 - 256) * 256 + 409600)
    assert windowed.cost(64) == full.cost(64)
    topo = Topology(dp=2, micro_batches=2, max_tokens=8192)
    plan = balancer.plan(lengths, topo, windowed, seed=0)
    plan.validate()
    assert plan.cost_model.window == 256
    work = plan.metrics()["lower_bound_epoch"]
    assert work == pytest.approx(windowed.cost(lengths).sum() / 2, rel=1e-9)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(window=0), "window"),
        (dict(window=2.5), "window"),
        (dict(piece_coef=-1.0), "piece_coef"),
        (dict(comm_coef=float("inf")), "comm_coef"),
        (dict(comm_latency=-1e-6), "comm_latency"),
    ],
)
def test_new_terms_reject_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CostModel(attn_coef=1.0, linear_coef=1.0, **kwargs)


def test_zero_new_terms_keep_section3():
    plain = CostModel(attn_coef=2.0, linear_coef=3.0, fixed=5.0)
    d = np.array([1, 2, 10])
    assert plain.cost(d).tolist() == [5, 12, 140]
    assert micro_batch_time(plain, d, cp=1) == plain.micro_batch_cost(d)
    with_pieces = CostModel(attn_coef=2.0, linear_coef=3.0, fixed=5.0, piece_coef=0.5)
    assert with_pieces.cost(d).tolist() == [5.5, 12.5, 140.5]
    assert micro_batch_time(with_pieces, d, cp=1) == with_pieces.micro_batch_cost(d)


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_zigzag_terms_match_the_layout(cp, causal):
    rng = np.random.default_rng(cp)
    lengths = rng.integers(1, 300, 25)
    cu = np.concatenate([[0], np.cumsum(lengths)])
    lay = attention.CPLayout.build(cu, cp, kind="zigzag")
    terms = micro_batch_terms(lengths, cp, "zigzag", causal=causal)
    assert terms.tokens.tolist() == lay.local_counts.tolist()
    assert terms.pairs.sum(axis=1).tolist() == lay.work(causal).tolist()
    assert terms.travel.tolist() == lay.local_counts.tolist()  # every document is split: all K/V travels
    for r in range(cp):
        for s in range(cp):
            assert terms.pairs[r, s] == lay.pieces(r, s, causal).pairs()
            assert terms.pieces[r, s] == len(lay.pieces(r, s, causal))
    windowed = micro_batch_terms(lengths, cp, "zigzag", causal=causal, window=17)
    assert windowed.pairs.sum() == attention_pairs(lengths, causal, 17).sum()


def test_ring_step_is_max_of_compute_and_transfer_plus_latency():
    lengths = np.array([400, 400])
    terms = micro_batch_terms(lengths, 2, "zigzag")
    compute_only = CostModel(attn_coef=1.0, linear_coef=0.0)
    assert rank_times(compute_only, terms).tolist() == terms.pairs.sum(axis=1).tolist()
    slow_link = CostModel(attn_coef=1e-9, linear_coef=1e-9, comm_coef=1.0, comm_latency=0.25)
    # both ranks hold 400 tokens, all of them travel: each of the 2 steps moves 400 tokens
    t = rank_times(slow_link, terms)
    assert t == pytest.approx([400e-9 + 2 * (400 + 0.25)] * 2, rel=1e-9)
    gathered = rank_times(slow_link, terms, "allgather")
    assert gathered == pytest.approx(400e-9 + 1e-9 * terms.pairs.sum(axis=1) + 400 + 0.25)
    with pytest.raises(ValueError, match="method"):
        rank_times(slow_link, terms, "broadcast")


def test_hardware_presets_are_seconds_from_public_figures():
    c = CostModel.from_model(4096, 32, 32, 8, 14336, 128256, hardware="h100-nvlink")
    flops = CostModel.from_model(4096, 32, 32, 8, 14336, 128256)
    hw = HARDWARE["h100-nvlink"]
    assert c.attn_coef == pytest.approx(flops.attn_coef / (hw.flops * hw.attn_efficiency))
    assert c.linear_coef == pytest.approx(flops.linear_coef / (hw.flops * hw.linear_efficiency))
    assert c.kv_bytes_per_token == 32 * 2 * 8 * 128 * (2 * 2 + 4)
    assert c.comm_coef == pytest.approx(c.kv_bytes_per_token / hw.link_bandwidth)
    ib = CostModel.from_model(4096, 32, 32, 8, 14336, 128256, hardware="h100-ib")
    assert ib.comm_coef > 5 * c.comm_coef and ib.attn_coef == c.attn_coef
    assert all(h.source for h in HARDWARE.values())
    with pytest.raises(ValueError, match="hardware"):
        CostModel.from_model(64, 2, 4, hardware="tpu-v9")
    mistral = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "sliding_window": 32}
    assert CostModel.from_config(mistral).window == 32
    assert CostModel.from_config({**mistral, "use_sliding_window": False}).window is None


def test_save_load_round_trip(tmp_path):
    c = CostModel(1e-9, 2e-6, 1e-3, window=512, piece_coef=1e-5, comm_coef=3e-8, comm_latency=2e-4)
    c.save(tmp_path / "cost.json", median_error=0.03)
    assert CostModel.load(tmp_path / "cost.json") == c
    (tmp_path / "bad.json").write_text('{"attn_coef": -1, "linear_coef": 1}')
    with pytest.raises(ValueError, match="attn_coef"):
        CostModel.load(tmp_path / "bad.json")
    (tmp_path / "junk.json").write_text("not json")
    with pytest.raises(ValueError, match="junk.json"):
        CostModel.load(tmp_path / "junk.json")


def test_fit_recovers_every_term():
    rng = np.random.default_rng(1)
    true = CostModel(attn_coef=2e-8, linear_coef=1e-5, fixed=2e-3, piece_coef=4e-4, comm_coef=2e-5, comm_latency=1e-3)
    samples, cps = [], []
    for i in range(48):
        kind = i % 3
        if kind == 0:
            docs = rng.integers(16, 300, rng.integers(10, 60))
        elif kind == 1:
            docs = np.concatenate([rng.integers(2000, 6000, rng.integers(1, 3)), rng.integers(16, 200, 5)])
        else:
            docs = rng.integers(200, 3000, rng.integers(2, 8))
        samples.append(docs)
        cps.append(1 + i % 2)
    seconds = np.array([micro_batch_time(true, s, c) for s, c in zip(samples, cps)])
    fit = CostModel.fit(samples, seconds, cp=cps, fit_pieces=True, fit_comm=True)
    predicted = np.array([micro_batch_time(fit, s, c) for s, c in zip(samples, cps)])
    assert np.max(np.abs(predicted / seconds - 1)) < 1e-3
    for name in ("attn_coef", "linear_coef", "fixed", "piece_coef", "comm_coef", "comm_latency"):
        assert getattr(fit, name) == pytest.approx(getattr(true, name), rel=0.05), name
    with pytest.raises(ValueError, match="cp > 1"):
        CostModel.fit(samples[:8], seconds[:8], cp=1, fit_comm=True)
    with pytest.raises(ValueError, match="at least 7 timed samples"):
        CostModel.fit(samples[:4], seconds[:4], cp=cps[:4], fit_pieces=True, fit_comm=True)


def test_plan_predict_reduces_to_metrics_without_new_terms():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 2000, 300) * 4  # multiples of 2*cp: zigzag splits every document evenly
    topo = Topology(dp=2, cp=2, micro_batches=2, max_tokens=4096)
    cost = CostModel(attn_coef=1e-3, linear_coef=1.0)
    plan = balancer.plan(lengths, topo, cost, seed=0)
    report = plan.predict()
    assert report["step_time_total"] >= report["compute_only_total"] * (1 - 1e-12)
    assert report["step_time_total"] == pytest.approx(report["compute_only_total"], rel=0.01)
    assert report["micro_batch_times"].shape == (plan.num_steps, 2, 2)
    comm = CostModel(attn_coef=1e-3, linear_coef=1.0, comm_coef=50.0, comm_latency=10.0, kv_bytes_per_token=8)
    slow = plan.predict(comm)
    assert slow["step_time_total"] > report["step_time_total"]
    assert slow["kv_bytes_moved"] == 8 * slow["kv_tokens_moved"] > 0
    assert plan.predict(comm, layout={"kind": "zigzag"})["step_time_total"] == slow["step_time_total"]
    assert plan.metrics()["step_time_total"] == pytest.approx(report["compute_only_total"])


def test_hybrid_terms_move_only_split_documents():
    lengths = np.array([30] * 40 + [5000])
    cu = np.concatenate([[0], np.cumsum(lengths)])
    lay = attention.CPLayout.build(cu, 2, kind="hybrid", split_threshold=1000)
    terms = micro_batch_terms(lengths, 2, "hybrid", split_threshold=1000)
    assert terms.tokens.tolist() == lay.local_counts.tolist()
    assert terms.travel.sum() == 5000 and bool(lay.split_docs[-1]) and not lay.split_docs[:-1].any()
    assert terms.pairs.sum() == attention_pairs(lengths).sum()
    zig = micro_batch_terms(lengths, 2, "zigzag")
    assert zig.travel.sum() > terms.travel.sum()
    assert terms.pieces.sum() < zig.pieces.sum()
