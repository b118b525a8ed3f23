"""cp_attention with every method (ring, allgather, ulysses) x sliding windows x softcap x GQA x layout kinds on
real gloo worlds of 2, 3 and 4 processes: output and all three gradients against the plain float64 reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.attn_ref import reference
from support.dist import run_world
from test_attention_cp import TOL, TOL_GRAD, rel

from attention import CPLayout, cp_attention
from attention.ulysses import kv_replication

pytestmark = pytest.mark.slow  # multi-process gloo


def check(rank, world, lens, heads, kv_heads, dtype, method, causal=True, window=(-1, -1), softcap=0.0,
          kind="zigzag", seed=0, layout_opts=None):  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    T, dim, scale = int(cu[-1]), 8, 0.3
    q, k, v = (
        torch.randn(T, h, dim, generator=gen, dtype=torch.float64).to(dtype) for h in (heads, kv_heads, kv_heads)
    )
    dout = torch.randn(T, heads, dim, generator=gen, dtype=torch.float64)
    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    ref = reference(qr, kr, vr, cu, causal, scale, window, softcap)
    ref_g = torch.autograd.grad(ref, (qr, kr, vr), dout)
    layout = CPLayout.build(cu, world, kind=kind, **(layout_opts or {}))
    ql, kl, vl = (layout.shard(x, rank).requires_grad_() for x in (q, k, v))
    out = cp_attention(ql, kl, vl, layout, causal=causal, softmax_scale=scale, method=method, window_size=window,
                       softcap=softcap)  # fmt: skip
    grads = torch.autograd.grad(out, (ql, kl, vl), layout.shard(dout, rank).to(dtype))
    what = (rank, world, lens, heads, kv_heads, dtype, method, causal, window, softcap, kind)
    assert rel(out, layout.shard(ref, rank), float(ref.detach().abs().max())) <= TOL[dtype], what
    dv_scale = float(ref_g[2].abs().max())
    for g, rg in zip(grads, ref_g):
        assert rel(g, layout.shard(rg, rank), max(float(rg.abs().max()), dv_scale)) <= TOL_GRAD[dtype], what


MASKS = [((-1, -1), 0.0, True), ((5, -1), 0.0, True), ((3, 2), 0.0, False), ((7, -1), 1.5, True)]


def _worker(rank, world):
    rng = np.random.default_rng(world)
    for case, (window, softcap, causal) in enumerate(MASKS):
        lens = rng.integers(1, 30, size=4)
        lens[0] = 2 * world + 1
        heads, kv_heads = [(world * 2, 2), (world, 1), (world * 2, world * 2), (world * 2, 1)][case]
        dtype = torch.float64 if case % 2 == 0 else torch.float32
        for method in ("ring", "allgather", "ulysses"):
            check(rank, world, lens, heads, kv_heads, dtype, method, causal, window, softcap, seed=case)
    # the contiguous layout, and documents shorter than the group
    check(rank, world, np.array([1, 2 * world - 1, 9]), world, 1, torch.float64, "ulysses", window=(2, -1))
    check(rank, world, np.array([11, 4]), world * 2, 2, torch.float64, "ring", window=(3, -1), kind="contiguous")
    check(rank, world, np.array([11, 4]), world * 2, 2, torch.float64, "ulysses", softcap=2.0, kind="contiguous")
    # the hybrid layout: documents above the threshold split, the rest whole on one rank, under every mask
    lens, opts = np.array([25, 3, 12, 6, 1, 18, 9]), {"split_threshold": 10}
    for method in ("ring", "allgather", "ulysses"):
        check(rank, world, lens, world * 2, 2, torch.float64, method, window=(4, -1), kind="hybrid", layout_opts=opts)
        check(rank, world, lens, world * 2, 1, torch.float32, method, False, (3, 2), 1.5, "hybrid", 1, opts)
    _ulysses_heads_not_divisible(rank, world)
    _argument_check_runs_once(rank, world)


def _argument_check_runs_once(rank, world):
    """The cross-rank argument check is exchanged on the first call for a layout, not on later identical ones."""
    import attention._dist as adist

    lay = CPLayout.build(np.array([0, 7, 20]), world)
    x = torch.randn(lay.num_local_tokens(rank), 2, 8, dtype=torch.float64)
    first = cp_attention(x, x, x, lay)
    real = adist.dist.all_gather
    adist.dist.all_gather = None  # any exchange now fails
    try:
        again = cp_attention(x, x, x, lay)
    finally:
        adist.dist.all_gather = real
    assert torch.equal(first, again)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_methods_masks_gqa(world):
    run_world(world, _worker)


def _ulysses_heads_not_divisible(rank, world):
    """Every rank raises (the error is exchanged like any other input error)."""
    lay = CPLayout.build(np.array([0, 9]), world)
    T = lay.num_local_tokens(rank)
    q, k = torch.randn(T, world + 1, 8), torch.randn(T, 1, 8)
    try:
        cp_attention(q, k, k, lay, method="ulysses")
    except ValueError as e:
        assert "not divisible" in str(e), str(e)
    else:
        raise AssertionError("no error for heads not divisible by the CP size")


def test_kv_replication():
    assert kv_replication(8, 8, 4) == 1
    assert kv_replication(8, 2, 4) == 2
    assert kv_replication(8, 1, 4) == 4
    assert kv_replication(12, 6, 4) == 2  # 6 K/V heads over 4 ranks: 12 replicas
    assert kv_replication(6, 3, 3) == 1
