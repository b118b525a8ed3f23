"""Backends, the float32 merge and varlen_attention (plain and chunked) against a plain float64 reference,
forward and backward."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.attn_ref import reference

from attention import Pieces, get_backend, merge_, varlen_attention
from attention.backends import ReferenceBackend, TorchCPUBackend

TOL = {torch.float64: 1e-9, torch.float32: 2e-5, torch.bfloat16: 1e-2}
TOL_GRAD = {torch.float64: 1e-9, torch.float32: 2e-5, torch.bfloat16: 2e-2}


def rel(a, b, scale=None):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max()) / (float(b.abs().max()) if scale is None else scale)


def problem(lens, heads, kv_heads, dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    T = int(cu[-1])
    q, k, v = (
        torch.randn(T, h, dim, generator=gen, dtype=torch.float64).to(dtype) for h in (heads, kv_heads, kv_heads)
    )
    dout = torch.randn(T, heads, dim, generator=gen, dtype=torch.float64)
    return cu, q, k, v, dout


CASES = [([5, 1, 17, 64, 3, 33], 4, 2), ([16, 16, 16, 7, 7], 4, 4), ([1, 1, 1], 2, 1), ([100], 6, 2)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("chunk_size", [None, pytest.param(13, marks=pytest.mark.slow)])  # chunked: ~5-13 s each
def test_varlen_attention(dtype, backend, causal, chunk_size):
    for lens, heads, kv_heads in CASES:
        cu, q, k, v, dout = problem(lens, heads, kv_heads, 8, dtype)
        scale = 0.37
        qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
        ref = reference(qr, kr, vr, cu, causal, scale)
        ref_g = torch.autograd.grad(ref, (qr, kr, vr), dout)
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        out = varlen_attention(
            qq,
            kk,
            vv,
            torch.from_numpy(cu).int(),
            causal=causal,
            softmax_scale=scale,
            backend=backend,
            chunk_size=chunk_size,
        )
        assert out.dtype == dtype
        assert rel(out, ref) <= TOL[dtype]
        grads = torch.autograd.grad(out, (qq, kk, vv), dout.to(dtype))
        dv_scale = float(ref_g[2].abs().max())
        for g, rg in zip(grads, ref_g):
            assert g.dtype == dtype
            assert rel(g, rg, max(float(rg.abs().max()), dv_scale)) <= TOL_GRAD[dtype]


def test_default_scale_and_auto_backend():
    cu, q, k, v, _ = problem([9, 4], 4, 2, 16, torch.float64)
    out = varlen_attention(q, k, v, cu)
    assert rel(out, reference(q, k, v, cu, True, 16**-0.5)) <= 1e-12
    assert get_backend("auto", q, k).name == "torch"  # CPU: PyTorch's fused kernel
    assert get_backend("reference", q, k).name == "reference"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_backends_on_arbitrary_pieces(dtype):
    """Backends agree with the reference backend on pieces with gaps, shared key ranges and same-shape groups,
    including the backward with externally merged out/lse (the ring's use)."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(40, 4, 8, generator=gen, dtype=dtype)
    k = torch.randn(30, 2, 8, generator=gen, dtype=dtype)
    v = torch.randn(30, 2, 8, generator=gen, dtype=dtype)
    p = Pieces(
        [0, 5, 10, 20, 30], [5, 5, 6, 6, 3], [0, 0, 10, 10, 25], [7, 7, 6, 6, 3], [False, False, True, False, True]
    )
    ref, tb = ReferenceBackend(), TorchCPUBackend()
    o1, l1 = ref.forward(q, k, v, p, 0.3)
    o2, l2 = tb.forward(q, k, v, p, 0.3)
    assert rel(o2, o1) <= TOL[dtype] and rel(l2[torch.isfinite(l1)], l1[torch.isfinite(l1)]) <= TOL[dtype]
    assert torch.isinf(l2[36:]).all() and (o2[36:] == 0).all()  # rows no piece covers
    dout = torch.randn(40, 4, 8, generator=gen, dtype=dtype)
    g1 = ref.backward(dout, q, k, v, o1, l1, p, 0.3)
    g2 = tb.backward(dout, q, k, v, o1.to(dtype), l1, p, 0.3)
    for a, b in zip(g2, g1):
        assert rel(a, b) <= TOL_GRAD[dtype]


def test_merge_is_exact():
    """Merging partial results over disjoint key sets equals attention over the union; -inf rows stay empty."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(6, 2, 4, generator=gen, dtype=torch.float64)
    k = torch.randn(10, 2, 4, generator=gen, dtype=torch.float64)
    v = torch.randn(10, 2, 4, generator=gen, dtype=torch.float64)
    ref = ReferenceBackend()
    full = ref.forward(q, k, v, Pieces([0], [5], [0], [10], False), 0.5)
    a = ref.forward(q, k, v, Pieces([0], [5], [0], [4], False), 0.5)
    b = ref.forward(q, k, v, Pieces([0], [5], [4], [6], False), 0.5)
    out, lse = a[0].clone(), a[1].clone()
    merge_(out, lse, *b)
    assert rel(out, full[0]) <= 1e-14 and rel(lse[:5], full[1][:5]) <= 1e-14
    assert torch.isinf(lse[5]).all() and (out[5] == 0).all()


def test_varlen_errors():
    cu, q, k, v, _ = problem([4, 4], 4, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="end at the token count"):
        varlen_attention(q, k, v, [0, 4, 7])
    with pytest.raises(ValueError, match="dtypes differ"):
        varlen_attention(q, k.double(), v, cu)
    with pytest.raises(ValueError, match="multiple of num kv heads"):
        varlen_attention(torch.randn(8, 3, 8), k, v, cu)
    with pytest.raises(ValueError, match="head_dim"):
        varlen_attention(torch.randn(8, 4, 4), k, v, cu)
    with pytest.raises(ValueError, match="backend"):
        varlen_attention(q, k, v, cu, backend="nope")
    with pytest.raises(ValueError, match="flash_attn"):
        varlen_attention(q, k, v, cu, backend="flash_attn")  # CPU tensors: never flash_attn
    with pytest.raises(ValueError, match="chunk_size"):
        varlen_attention(q, k, v, cu, chunk_size=0)
