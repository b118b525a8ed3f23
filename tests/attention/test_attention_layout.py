"""CPLayout properties (hypothesis): round trip, every token on exactly one rank, balanced causal work within the
documented remainder slack, tiny documents, the contiguous kind, and the attention blocks it hands the kernels."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attention import CPLayout

lengths = st.lists(st.integers(0, 300), min_size=1, max_size=12)
cps = st.integers(1, 6)


def _cu(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)


def _slack(d: int, cp: int) -> int:
    """Documented bound on (max - min) per-rank causal pairs of one zigzag document."""
    b, rem = divmod(d, 2 * cp)
    m = min(rem, 2 * cp - rem)
    return 0 if rem == 0 else (m - 1) * (2 * b + 1) + 1


@settings(max_examples=150, deadline=None)
@given(lengths, cps, st.sampled_from(["zigzag", "contiguous", "hybrid"]))
def test_every_token_once_and_round_trip(lens, cp, kind):
    lay = CPLayout.build(_cu(lens), cp, kind=kind)
    T = int(sum(lens))
    idx = np.concatenate([lay.local_indices(r) for r in range(cp)])
    assert np.array_equal(np.sort(idx), np.arange(T))  # every token on exactly one rank
    x = torch.randn(T, 3)
    parts = [lay.shard(x, r) for r in range(cp)]
    assert [p.shape[0] for p in parts] == list(lay.local_counts)
    assert torch.equal(lay.unshard(parts), x)
    cu = _cu(lens)
    for r in range(cp):
        li = lay.local_indices(r)
        doc = np.searchsorted(cu, li, side="right") - 1
        assert np.array_equal(doc, lay.local_doc_ids(r))
        assert np.array_equal(lay.position_ids(r), li - cu[doc])
        lcu = lay.local_cu_seqlens(r)
        assert np.array_equal(np.diff(lcu), np.bincount(doc, minlength=len(lens)))
        # local order inside a document is document order (the causal local step relies on it)
        assert (np.diff(li)[np.diff(doc) == 0] > 0).all()


@pytest.mark.slow  # ~4 s
@settings(max_examples=200, deadline=None)
@given(lengths, cps)
def test_zigzag_balance(lens, cp):
    lay = CPLayout.build(_cu(lens), cp)
    # per document: token counts within one, causal pairs within the documented slack
    for d in lens:
        one = CPLayout.build(np.array([0, d]), cp)
        assert one.local_counts.max() - one.local_counts.min() <= 1
        w = one.work(causal=True)
        assert w.sum() == d * (d + 1) // 2
        assert w.max() - w.min() <= _slack(d, cp), (d, cp, w)
    w = lay.work(causal=True)
    assert w.sum() == sum(d * (d + 1) // 2 for d in lens)
    assert w.max() - w.min() <= sum(_slack(d, cp) for d in lens)
    assert lay.work(causal=False).sum() == sum(d * d for d in lens)
    if all(d % (2 * cp) == 0 for d in lens):
        assert (w == w[0]).all()


def test_work_counts_pairs_directly():
    """work() against a brute-force count of (query, key) pairs per rank."""
    lens = [1, 3, 7, 8, 13, 2]
    for cp in (2, 3, 4):
        for kind in ("zigzag", "contiguous", "hybrid"):
            lay = CPLayout.build(_cu(lens), cp, kind=kind)
            for r in range(cp):
                pos = lay.position_ids(r)
                assert lay.work(True)[r] == int((pos + 1).sum())
                assert lay.work(False)[r] == int(np.array(lens)[lay.local_doc_ids(r)].sum())


def test_tiny_documents():
    lay = CPLayout.build(np.array([0, 1]), 4)  # a 1-token document on 4 ranks
    assert list(lay.local_counts) == [1, 0, 0, 0]
    lay = CPLayout.build(np.array([0, 3]), 4)  # 3 tokens on 4 ranks: front chunks of ranks 0, 1, 2
    assert list(lay.local_counts) == [1, 1, 1, 0]
    assert [list(lay.position_ids(r)) for r in range(4)] == [[0], [1], [2], []]
    lay = CPLayout.build(np.array([0, 7]), 2)  # rem 3 > cp: last 3 chunks get the extra token
    assert lay.bounds[0].tolist() == [0, 1, 3, 5, 7]
    assert [list(lay.position_ids(r)) for r in range(2)] == [[0, 5, 6], [1, 2, 3, 4]]
    lay = CPLayout.build(np.array([0, 0, 5]), 2)  # empty documents are allowed
    assert lay.local_counts.sum() == 5


def test_zigzag_chunks():
    lay = CPLayout.build(np.array([0, 8, 24]), 2)  # equal chunks: rank r holds chunks r, 3-r
    assert lay.position_ids(0).tolist() == [0, 1, 6, 7] + [0, 1, 2, 3, 12, 13, 14, 15]
    assert lay.position_ids(1).tolist() == [2, 3, 4, 5] + [4, 5, 6, 7, 8, 9, 10, 11]
    assert lay.local_cu_seqlens(1).tolist() == [0, 4, 12]


def test_contiguous_kind():
    lay = CPLayout.build(np.array([0, 10]), 3, kind="contiguous")
    assert [lay.position_ids(r).tolist() for r in range(3)] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    w = lay.work()
    assert w[0] < w[1] < w[2]  # contiguous is unbalanced for causal attention


def test_pieces_cover_exactly_the_causal_pairs():
    """Blocks from pieces(r, s) over all s are exactly the (query, key) pairs of the causal mask."""
    lens = [1, 3, 9, 16, 2, 31]
    cu = _cu(lens)
    for cp in (1, 2, 3, 4):
        for kind in ("zigzag", "contiguous", "hybrid"):
            for causal in (True, False):
                lay = CPLayout.build(cu, cp, kind=kind, **({"split_threshold": 8} if kind == "hybrid" else {}))
                got = set()
                for r in range(cp):
                    gq = lay.local_indices(r)
                    for s in range(cp):
                        p = lay.pieces(r, s, causal)
                        gk = lay.local_indices(s)
                        if s != r:  # the same blocks against the keys that travel
                            gk, p = lay.kv_indices(s), lay.to_travelling([p], s)[0]
                        for i in range(len(p)):
                            qs, ql, ks, kl = p.q_start[i], p.q_len[i], p.k_start[i], p.k_len[i]
                            for a in range(ql):
                                for b in range(kl):
                                    if p.causal[i] and b > a:
                                        continue
                                    pair = (gq[qs + a], gk[ks + b])
                                    assert pair not in got
                                    got.add(pair)
                want = set()
                for i, d in enumerate(lens):
                    for a in range(d):
                        for b in range(d if not causal else a + 1):
                            want.add((cu[i] + a, cu[i] + b))
                assert got == want, (cp, kind, causal)


def test_errors():
    with pytest.raises(ValueError):
        CPLayout.build(np.array([1, 5]), 2)
    with pytest.raises(ValueError):
        CPLayout.build(np.array([0, 5, 3]), 2)
    with pytest.raises(ValueError):
        CPLayout.build(np.array([0, 5]), 0)
    with pytest.raises(ValueError):
        CPLayout.build(np.array([0, 5]), 2, kind="ring")
    with pytest.raises(ValueError):
        CPLayout.build(np.array([0.0, 5.0]), 2)
    lay = CPLayout.build(np.array([0, 5]), 2)
    with pytest.raises(ValueError):
        lay.shard(torch.zeros(4, 2), 0)
    with pytest.raises(ValueError):
        lay.shard(torch.zeros(5, 2), 2)
    with pytest.raises(ValueError):
        lay.unshard([torch.zeros(3), torch.zeros(3)])


@pytest.mark.slow  # 100K documents: ~45 s
def test_build_handles_100k_documents():
    """A large batch builds (vectorised construction; its speed is a benchmark's business, not a test's) and every
    token lands on exactly one rank."""
    rng = np.random.default_rng(0)
    lens = rng.integers(1, 4000, size=100_000)
    lay = CPLayout.build(_cu(lens), 8)
    counts = [lay.local_indices(r).shape[0] for r in range(8)]
    assert counts == list(lay.local_counts) and sum(counts) == int(lens.sum())
    assert np.array_equal(np.sort(np.concatenate([lay.local_indices(r) for r in range(8)])), np.arange(lens.sum()))
    assert len(lay.pieces(3, 5, True)) > 0


# ---------------------------------------------------------------------------------------------- hybrid
hybrid_opts = st.fixed_dictionaries(
    {},
    optional={
        "split_threshold": st.integers(1, 400),
        "max_tokens": st.integers(1, 2000),
    },
)


def _relative_load(lay: CPLayout) -> float:
    lens = np.diff(lay.cu_seqlens)
    tokens, pairs = max(int(lens.sum()), 1), max(int((lens * (lens + 1) // 2).sum()), 1)
    return float(np.maximum(lay.work() * lay.cp_size / pairs, lay.local_counts * lay.cp_size / tokens).max())


@settings(max_examples=200, deadline=None)
@given(lengths, cps, hybrid_opts)
def test_hybrid_split_placement_and_caps(lens, cp, opts):
    """Whole documents sit entirely on their rank, split ones are zigzag shares; longer-than-threshold documents are
    split; max_tokens holds whenever it can (it can when the zigzag layout fits); the result is deterministic."""
    cu = _cu(lens)
    zig = CPLayout.build(cu, cp)
    try:
        lay = CPLayout.build(cu, cp, kind="hybrid", **opts)
    except ValueError as e:
        assert "max_tokens" in str(e)
        assert zig.local_counts.max() > opts["max_tokens"]  # only when zigzag would not fit either
        return
    lens = np.array(lens, dtype=np.int64)
    split, where = lay.split_docs, lay.doc_rank
    assert split.dtype == bool and split.shape == lens.shape
    assert ((where == -1) == split).all() and (where < cp).all()
    whole = np.nonzero(~split)[0]
    assert (lay.seg_len[where[whole], whole] == lens[whole]).all()  # the whole document on its rank
    assert np.array_equal(lay.seg_len[:, split], zig.seg_len[:, split])  # split: exactly the zigzag shares
    assert (lay.kv_counts == lay.seg_len[:, split].sum(axis=1)).all()
    if "split_threshold" in opts:
        assert split[lens > opts["split_threshold"]].all()
    if "max_tokens" in opts:
        assert lay.local_counts.max() <= opts["max_tokens"]
    elif "split_threshold" not in opts:  # the balance rule
        assert split.all() or _relative_load(lay) <= 1.02 + 1e-12
    # no rank without a token while a whole document of 2+ tokens could have been split to fill it
    assert lay.local_counts.min() > 0 or not (~split & (lens >= 2)).any()
    again = CPLayout.build(cu.copy(), cp, kind="hybrid", **opts)
    assert np.array_equal(again.doc_rank, lay.doc_rank) and again.fingerprint() == lay.fingerprint()
    spec = json.loads(json.dumps(lay.layout_spec()))
    assert CPLayout.from_spec(cu, cp, spec).fingerprint() == lay.fingerprint()


def test_hybrid_keeps_short_documents_whole_and_balanced():
    rng = np.random.default_rng(0)
    lens = np.exp(rng.uniform(np.log(16), np.log(4000), 200)).astype(int)  # SFT-like
    for cp in (2, 4, 8):
        lay = CPLayout.build(_cu(lens), cp, kind="hybrid")
        assert not lay.split_docs.any()  # nothing travels
        assert lay.kv_counts.sum() == 0
        assert _relative_load(lay) <= 1.02
    mixed = np.concatenate([lens[:60], [9000, 12000, 7000]])
    lay = CPLayout.build(_cu(mixed), 4, kind="hybrid")
    assert lay.split_docs[-3:].all() and lay.split_docs.sum() <= 4
    assert _relative_load(lay) <= 1.02
    # a document longer than max_tokens is split even below the threshold
    lay = CPLayout.build(_cu([100, 10, 10]), 2, kind="hybrid", split_threshold=1000, max_tokens=60)
    assert lay.split_docs.tolist() == [True, False, False]
    # a single document on two ranks is split: whole, one rank would do all the work
    assert CPLayout.build(_cu([100]), 2, kind="hybrid").split_docs.tolist() == [True]
    assert CPLayout.build(_cu([100]), 1, kind="hybrid").split_docs.tolist() == [False]
    # tolerance: how uneven the automatic rule lets the ranks be before it splits
    assert CPLayout.build(_cu([100, 50]), 2, kind="hybrid").split_docs.tolist() == [True, True]
    assert CPLayout.build(_cu([100, 50]), 2, kind="hybrid", tolerance=1.0).split_docs.tolist() == [False, False]


def test_layout_specs_and_fingerprints_differ_by_options():
    cu = _cu([5, 50, 7, 9, 400])
    lays = [
        CPLayout.build(cu, 2),
        CPLayout.build(cu, 2, kind="hybrid"),
        CPLayout.build(cu, 2, kind="hybrid", split_threshold=1000),
        CPLayout.build(cu, 2, kind="hybrid", max_tokens=10_000),
    ]
    assert lays[0].layout_spec() == {"kind": "zigzag"}
    assert lays[3].layout_spec() == {"kind": "hybrid", "split_threshold": None, "max_tokens": 10_000, "tolerance": None}
    assert len({lay.fingerprint() for lay in lays}) == len(lays)


@pytest.mark.parametrize(
    "opts, match",
    [
        ({"split_threshold": 0}, "split_threshold"),
        ({"split_threshold": -3}, "split_threshold"),
        ({"split_threshold": 2.5}, "split_threshold"),
        ({"split_threshold": True}, "split_threshold"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "8k"}, "max_tokens"),
        ({"tolerance": -0.1}, "tolerance"),
        ({"tolerance": 0.1, "split_threshold": 5}, "tolerance"),
        ({"max_tokens": 20}, "max_tokens=20 cannot hold"),
    ],
)
def test_hybrid_bad_options(opts, match):
    with pytest.raises(ValueError, match=match):
        CPLayout.build(_cu([30, 30]), 2, kind="hybrid", **opts)


def test_options_of_other_kinds_and_bad_specs():
    with pytest.raises(ValueError, match="split_threshold is an option of the hybrid layout"):
        CPLayout.build(_cu([3]), 2, kind="zigzag", split_threshold=4)
    with pytest.raises(ValueError, match="unknown layout option"):
        CPLayout.from_spec(_cu([3]), 2, {"kind": "hybrid", "threshold": 4})
    with pytest.raises(ValueError, match="'kind'"):
        CPLayout.from_spec(_cu([3]), 2, {"split_threshold": 4})


def test_hybrid_handles_a_large_batch():
    """5,000 documents: every token on exactly one rank (construction speed is measured by the benchmarks)."""
    lens = np.random.default_rng(1).integers(1, 4000, size=5_000)
    lay = CPLayout.build(_cu(lens), 8, kind="hybrid")
    held = np.sort(np.concatenate([lay.local_indices(r) for r in range(8)]))
    assert np.array_equal(held, np.arange(lens.sum()))


def test_build_names_the_new_home_of_the_cost_option():
    """The cost-driven choice moved to the planner: passing `cost=` names where it went instead of a TypeError."""
    with pytest.raises(ValueError, match="hybrid_split"):
        CPLayout.build(_cu([5, 9, 3]), 2, kind="hybrid", cost={"attn_coef": 1e-8, "linear_coef": 0})


@pytest.mark.parametrize(
    "split,match",
    [([2, 0], "increasing"), ([-1], "non-negative"), ([7], "batch has 3 documents"), ([[0]], "1-D")],
)
def test_explicit_split_bad_values(split, match):
    with pytest.raises(ValueError, match=match):
        CPLayout.build(_cu([5, 9, 3]), 2, kind="hybrid", split=split)


def test_explicit_split_must_be_final():
    """A split set under which a whole document fits on no rank is refused, naming the documents to add."""
    with pytest.raises(ValueError, match="not a final split set"):
        CPLayout.build(_cu([50, 9, 3]), 2, kind="hybrid", split=[], max_tokens=30)
