"""Sliding windows and softcap on varlen_attention (plain and chunked, every CPU backend) and the windowed
attention blocks between CP ranks (exactly the in-window pairs, blocks outside the window skipped)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.attn_ref import reference
from test_attention_kernels import TOL, TOL_GRAD, problem, rel

from attention import CPLayout, varlen_attention
from attention.masks import block_rounds, make_mask

LENS = [5, 1, 17, 24, 3, 12]
MASKS = [  # (causal, window, softcap)
    (True, (4, -1), 0.0),
    (True, (0, 0), 0.0),
    (False, (3, 6), 0.0),
    (False, (-1, 2), 1.3),
    (True, (-1, -1), 0.7),
    (True, (9, -1), 2.0),
]


@pytest.mark.slow  # ~7-11 s per case
@pytest.mark.parametrize(
    "dtype,backend,chunk_size",
    [(torch.float64, "torch", None), (torch.float64, "reference", 7), (torch.float32, "torch", 7)],
)
def test_varlen_window_softcap(dtype, backend, chunk_size):
    for causal, window, softcap in MASKS:
        cu, q, k, v, dout = problem(LENS, 4, 2, 8, dtype)
        qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
        ref = reference(qr, kr, vr, cu, causal, 0.4, window, softcap)
        ref_g = torch.autograd.grad(ref, (qr, kr, vr), dout)
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        out = varlen_attention(qq, kk, vv, cu, causal, 0.4, backend, chunk_size, window, softcap)
        assert rel(out, ref) <= TOL[dtype], (causal, window, softcap)
        grads = torch.autograd.grad(out, (qq, kk, vv), dout.to(dtype))
        scale = float(ref_g[2].abs().max())
        for g, rg in zip(grads, ref_g):
            assert rel(g, rg, max(float(rg.abs().max()), scale)) <= TOL_GRAD[dtype], (causal, window, softcap)


def _pairs_by_brute_force(layout, r, s, causal, window):
    """In-window (query, key) pairs between rank r's queries and rank s's keys, from global positions."""
    cu = layout.cu_seqlens
    qi, ki = layout.local_indices(r), layout.local_indices(s)
    doc = np.searchsorted(cu, np.arange(cu[-1]), side="right") - 1
    pos = np.arange(cu[-1]) - cu[doc]
    d = pos[qi][:, None] - pos[ki][None, :]
    ok = doc[qi][:, None] == doc[ki][None, :]
    if causal:
        ok &= d >= 0
    if window[0] >= 0:
        ok &= d <= window[0]
    if window[1] >= 0:
        ok &= d >= -window[1]
    return int(ok.sum())


@pytest.mark.parametrize("kind", ["zigzag", "contiguous"])
def test_windowed_blocks_cover_exactly_the_window(kind):
    cu = np.concatenate([[0], np.cumsum([40, 3, 64, 1, 17])])
    for cp in (2, 3, 4):
        lay = CPLayout.build(cu, cp, kind=kind)
        for causal, window in ((True, (5, -1)), (False, (2, 3)), (True, (0, -1))):
            mask = make_mask(causal, window)
            skipped = 0
            for r in range(cp):
                for s in range(cp):
                    rounds = block_rounds(lay, r, s, mask)
                    skipped += not rounds
                    assert sum(p.pairs() for p in rounds) == _pairs_by_brute_force(lay, r, s, causal, window)
                    for p in rounds:  # query ranges within a round are disjoint
                        rows = np.concatenate([np.arange(a, a + n) for a, n in zip(p.q_start, p.q_len)])
                        assert np.unique(rows).shape[0] == rows.shape[0]
            if window == (0, -1):
                assert skipped >= cp * (cp - 1) - 2 * cp  # a diagonal-only window leaves most steps empty


def test_mask_argument_errors():
    cu, q, k, v, _ = problem([4, 4], 4, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="window_size"):
        varlen_attention(q, k, v, cu, window_size=(-2, 0))
    with pytest.raises(ValueError, match="window_size"):
        varlen_attention(q, k, v, cu, window_size=5)
    with pytest.raises(ValueError, match="softcap"):
        varlen_attention(q, k, v, cu, softcap=-1.0)
