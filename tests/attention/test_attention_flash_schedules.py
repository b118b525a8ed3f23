"""Every CP schedule the project builds, driven through each flash binding's kernel-faithful CPU stand-in
(support.flash_signatures: the releases' signatures, the kernels' C++ window/causal/GQA rules), equals the float64
reference: ring, all-gather and Ulysses, zigzag / contiguous / hybrid layouts, W = 2, 3, 4, causal, full, sliding
windows (left only, left + right), softcap, GQA, forward and backward. A hypothesis property test over random
windowed schedules checks that no kernel call is misread (no row whose keys the kernel's window mapping changes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.attn_ref import reference
from support.flash_signatures import CALLS, FA3_VERSIONS, STATE, TORCH_OPS, VERSIONS

from attention.backends import FlashAttn3Backend, FlashAttnBackend, TorchCUDABackend
from attention.simulate import simulate

BINDINGS = list(VERSIONS) + ["torch-2.13"]
SOFTCAP = {"2.6.3", "2.7.4", "2.8.3", "fa3-2025", "fa3-op"}  # versions whose kernels take a softcap
TOL = 2e-6  # the kernels return a float32 lse; everything else is float64


def backend(version: str):
    if version in TORCH_OPS:
        b = TorchCUDABackend(ops=TORCH_OPS[version])
    else:
        fwd, bwd, _ = VERSIONS[version]
        b = (FlashAttn3Backend if version in FA3_VERSIONS else FlashAttnBackend)(functions=(fwd, bwd))
    assert b.available(), b.problem
    return b


def _data(lens, heads, kv_heads, seed=0):
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    gen = torch.Generator().manual_seed(seed)
    t = int(cu[-1])
    q = torch.randn(t, heads, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(t, kv_heads, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(t, heads, 8, generator=gen, dtype=torch.float64)
    return cu, q, k, v, dout


def check(b, lens, cp, method, kind, causal, window, softcap, heads=4, kv_heads=2, seed=0):
    """Simulated schedule through backend ``b`` vs the float64 reference; returns the kernel calls made."""
    cu, q, k, v, dout = _data(lens, heads, kv_heads, seed)
    x = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference(*x, cu, causal, 0.35, window, softcap)
    ref_g = torch.autograd.grad(ref, x, dout)
    CALLS.clear()
    out, grads = simulate(q, k, v, cu, cp, method, kind, causal, 0.35, window, softcap, b, dout)
    ref = ref.detach()
    scale = float(ref.abs().max())
    where = f"{method} {kind} W={cp} causal={causal} window={window} softcap={softcap} lens={list(lens)}"
    assert float((out - ref).abs().max()) <= TOL * scale, where
    for g, rg in zip(grads, ref_g):
        assert float((g - rg).abs().max()) <= TOL * max(1.0, float(rg.abs().max())), where
    return list(CALLS)


# (causal, window)
MASKS = [(True, (-1, -1)), (False, (-1, -1)), (True, (11, -1)), (False, (7, 5)), (False, (13, -1)), (True, (40, -1))]


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny kernels: one intra-op thread (a shared 2-core machine makes thread pools spin, not compute)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


CASES = [  # (cp, kind, method, causal, window, softcap?, kv_heads): every axis at least once per binding
    (2, "zigzag", "ring", True, (11, -1), False, 2),
    (3, "contiguous", "allgather", False, (7, 5), True, 1),
    (4, "hybrid", "ulysses", True, (40, -1), False, 1),
    (4, "zigzag", "allgather", False, (-1, -1), True, 2),
    (3, "hybrid", "ring", True, (-1, -1), False, 4),
    (2, "contiguous", "ulysses", False, (13, -1), True, 2),
]


@pytest.mark.parametrize("version", BINDINGS)
def test_every_schedule_through_each_binding(version):
    """Every method, layout, CP size and mask at least once through each binding (the product is the slow test)."""
    b = backend(version)
    for cp, kind, method, causal, window, cap, kv_heads in CASES:
        softcap = 2.0 if cap and version in SOFTCAP else 0.0
        calls = check(b, [37, 5, 64, 3, 20, 1, 90], cp, method, kind, causal, window, softcap, kv_heads=kv_heads)
        assert {c["version"] for c in calls} == {version}
        assert sum(c.get("changed_rows", 0) for c in calls) == 0


@pytest.mark.parametrize("version", ["2.8.3", "fa3-2024", "torch-2.13"])
def test_tall_windowed_blocks_are_not_misread(version):
    """The case behind the defect: zigzag gives rank W-1 two adjacent chunks (a block of 2c queries against c keys
    of another rank); with a left window and no right bound flash-attn 2's C++ turns right = -1 into
    max_seqlen_k and the block's first rows lost keys (errors of 0.3-1.3 here before the fix)."""
    calls = check(backend(version), [37, 5, 64, 3, 20], 2, "ring", "zigzag", True, (25, -1), 0.0)
    assert any(c["window"][0] >= 0 and c["window"][1] == -1 for c in calls if c["kind"] == "fwd")
    assert sum(c.get("changed_rows", 0) for c in calls) == 0


@pytest.mark.slow
@pytest.mark.parametrize("version", ["2.5.9", "2.8.3", "fa3-2024", "fa3-op", "torch-2.13"])
def test_full_product_of_schedules(version):
    b = backend(version)
    for cp in (2, 3, 4):
        for kind in ("zigzag", "contiguous", "hybrid"):
            for causal, window in MASKS:
                for method in ("ring", "allgather") + (("ulysses",) if 4 % cp == 0 else ()):
                    check(b, [29, 4, 70, 2, 17, 1], cp, method, kind, causal, window, 0.0)


@pytest.mark.parametrize("padded", [False, True])
def test_padded_lse_layout_of_older_kernels(padded):
    """flash-attn 2.5 returns the lse padded ``[B, H, max_q]``; 2.6+ unpadded: both reach the same result."""
    STATE["padded"] = padded
    FlashAttnBackend._lse_padded = None
    try:
        check(backend("2.5.0"), [37, 5, 64, 3], 3, "ring", "zigzag", True, (11, -1), 0.0)
    finally:
        STATE["padded"] = False
        FlashAttnBackend._lse_padded = None


@st.composite
def schedules(draw):
    lens = draw(st.lists(st.integers(1, 90), min_size=1, max_size=6))
    cp = draw(st.sampled_from([2, 3, 4]))
    causal = draw(st.booleans())
    left = draw(st.integers(0, 100))
    right = -1 if causal or draw(st.booleans()) else draw(st.integers(0, 60))
    kind = draw(st.sampled_from(["zigzag", "contiguous", "hybrid"]))
    method = draw(st.sampled_from(["ring", "allgather"]))
    return dict(lens=lens, cp=cp, causal=causal, window=(left, right), kind=kind, method=method,
                kv_heads=draw(st.sampled_from([1, 2, 4])))  # fmt: skip


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(s=schedules(), version=st.sampled_from(["2.8.3", "fa3-2024", "torch-2.13", "fa3-op"]))
def test_random_windowed_schedules_are_never_misread(s, version):
    """Random windowed ring / all-gather schedules: every kernel call's rows see exactly the keys asked for under
    the kernel's own window mapping, and the result equals the reference (finds the right-window -1 defect of
    flash-attn 2 / PyTorch / FA3-beta on blocks with more queries than keys + 1)."""
    calls = check(backend(version), s["lens"], s["cp"], s["method"], s["kind"], s["causal"], s["window"], 0.0,
                  kv_heads=s["kv_heads"])  # fmt: skip
    assert sum(c.get("changed_rows", 0) for c in calls) == 0
