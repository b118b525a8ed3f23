"""CPLayout properties (hypothesis): round trip, every token on exactly one rank, balanced causal work within the
documented remainder slack, tiny documents, the contiguous kind, and the attention blocks it hands the kernels."""

from __future__ import annotations

import time

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
@given(lengths, cps, st.sampled_from(["zigzag", "contiguous"]))
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
        for kind in ("zigzag", "contiguous"):
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
        for kind in ("zigzag", "contiguous"):
            for causal in (True, False):
                lay = CPLayout.build(cu, cp, kind=kind)
                got = set()
                for r in range(cp):
                    gq = lay.local_indices(r)
                    for s in range(cp):
                        gk = lay.local_indices(s)
                        p = lay.pieces(r, s, causal)
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


def test_build_is_cheap_for_100k_documents():
    rng = np.random.default_rng(0)
    lens = rng.integers(1, 4000, size=100_000)
    t = time.perf_counter()
    lay = CPLayout.build(_cu(lens), 8)
    idx = lay.local_indices(3)
    lay.work()
    lay.pieces(3, 5, True)
    assert time.perf_counter() - t < 2.0
    assert idx.shape[0] == lay.local_counts[3]
