"""The CUDA kernels' glue, on CPU: the flash-attn argument adapters fed the recorded signatures of flash-attn 2.5.0,
2.6.3, 2.7.4, 2.8.3 and 3 (stand-ins computing with the kernels' conventions), end to end through the varlen driver
(mask grouping, bottom-right windows, lse layouts, backward) against the reference backend; lse conversions for
both layouts and the max_q == 1 GQA swap; honest selection."""

from __future__ import annotations

import inspect
import logging

import numpy as np
import pytest
import torch
from support.flash_signatures import CALLS, STATE, VERSIONS

from attention import Pieces
from attention.backends import (
    UNBOUNDED,
    ArgAdapter,
    FlashAttn3Backend,
    FlashAttnBackend,
    Packed,
    ReferenceBackend,
    get_backend,
    kernel_windows,
    signature_params,
)
from attention.backends import select as sel


def _backend(version):
    cls = FlashAttn3Backend if version == "fa3" else FlashAttnBackend
    b = cls(functions=VERSIONS[version])
    assert b.available(), b.problem
    return b


def _pieces(softcap=0.0, single_rows=False):
    """Full, causal and banded pieces, gaps, shared key ranges (a ring step's shape after window trimming)."""
    if single_rows:
        return Pieces([0, 3, 9], [1, 1, 1], [0, 2, 20], [4, 6, 1], False, softcap=softcap)
    lo = [-(7 - 1), 0, -2, -UNBOUNDED, 3]
    hi = [UNBOUNDED, UNBOUNDED, 4, 1, UNBOUNDED]
    return Pieces([0, 5, 12, 20, 30], [5, 6, 8, 6, 7], [0, 5, 3, 10, 21], [7, 6, 9, 6, 9], False, lo, hi, softcap)


def _check(backend, p, heads=(4, 2)):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(40, heads[0], 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(30, heads[1], 8, generator=gen, dtype=torch.float64) for _ in range(2))
    ref = ReferenceBackend()
    o1, l1 = ref.forward(q, k, v, p, 0.4)
    o2, l2 = backend.forward(q, k, v, p, 0.4)
    fin = torch.isfinite(l1)
    assert torch.equal(fin, torch.isfinite(l2))
    assert (o2.double() - o1).abs().max() <= 1e-6 and (l2[fin].double() - l1[fin]).abs().max() <= 1e-5
    dout = torch.randn(40, heads[0], 8, generator=gen, dtype=torch.float64)
    g1 = ref.backward(dout, q, k, v, o1, l1, p, 0.4)
    g2 = backend.backward(dout, q, k, v, o1, l1, p, 0.4)
    for a, b in zip(g2, g1):
        assert (a.double() - b).abs().max() <= 1e-9 * max(1.0, float(b.abs().max()))


@pytest.mark.parametrize("version", list(VERSIONS))
@pytest.mark.parametrize("padded", [False, True])
def test_flash_adapters_end_to_end(version, padded):
    if version == "fa3" and padded:
        pytest.skip("flash-attn 3 returns the unpadded layout only")
    STATE["padded"] = padded
    type(_backend(version))._lse_padded = None
    try:
        b = _backend(version)
        softcap = 0.0 if version == "2.5.0" else 1.5
        assert b.has_window and b.has_softcap == (version != "2.5.0")
        for p in (_pieces(softcap), _pieces(softcap, single_rows=True)):
            CALLS.clear()
            _check(b, p)
            assert {c["version"] for c in CALLS} == {version}
            assert {c["kind"] for c in CALLS} == {"fwd", "bwd"}
    finally:
        STATE["padded"] = False
        type(_backend(version))._lse_padded = None


def test_deterministic_follows_torch():
    b = _backend("2.7.4")
    prev = torch.are_deterministic_algorithms_enabled()
    try:
        for flag in (True, False):
            torch.use_deterministic_algorithms(flag)
            CALLS.clear()
            _check(b, _pieces())
            assert {c["deterministic"] for c in CALLS if c["kind"] == "bwd"} == {flag}
    finally:
        torch.use_deterministic_algorithms(prev)


def test_softcap_refused_where_the_kernel_lacks_it():
    b = _backend("2.5.0")
    q = torch.zeros(4, 2, 64)
    assert "softcap" in b.why_not(q, q, softcap=True) or not q.is_cuda
    with pytest.raises(RuntimeError, match="softcap"):
        b.fwd_adapter.kwargs(dict(q=q, softcap=1.0))


def test_signature_without_causal_is_refused():
    """A function that matches by name but has no parameter for `causal` must not be used (causal would be
    dropped silently)."""

    def fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None, **kw):
        raise AssertionError("must not be called")

    b = FlashAttnBackend(functions=(fwd, VERSIONS["2.7.4"][1]))
    assert not b.available() and "causal" in b.problem
    # FA3's backward spells it is_causal: accepted through the alias, and the value reaches it
    CALLS.clear()
    _check(_backend("fa3"), Pieces([0], [6], [0], [6], True))
    assert [c["causal"] for c in CALLS] == [True, True]


def test_required_parameter_without_value_raises():
    def fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, mystery):
        raise AssertionError("must not be called")

    ad = ArgAdapter(signature_params(fwd), ("causal",))
    assert ad.error == ""
    with pytest.raises(RuntimeError, match="mystery"):
        ad.kwargs(dict(q=1, k=1, v=1, cu_seqlens_q=1, cu_seqlens_k=1, max_seqlen_q=1, max_seqlen_k=1,
                       softmax_scale=1.0, causal=True))  # fmt: skip


def test_recorded_signatures_are_what_the_stand_ins_declare():
    """Guards the stand-ins: the parameters the adapters rely on are where the releases put them."""
    names = {v: list(signature_params(f[0])) for v, f in VERSIONS.items()}
    assert "window_size" in names["2.5.0"] and "softcap" not in names["2.5.0"]
    assert names["2.6.3"].index("softcap") == names["2.6.3"].index("window_size") + 1
    assert {"window_size_left", "window_size_right", "leftpad_k"} <= set(names["2.8.3"])
    assert "is_causal" in inspect.signature(VERSIONS["fa3"][1]).parameters and "k_new" in names["fa3"]


def test_kernel_windows_bottom_right():
    p = _pieces()
    w = kernel_windows(p)
    assert (w[p.causal, 0] == 1).all() and (w[p.full & ~p.causal, 1:] == -1).all()
    assert (w[p.banded][:, 1:] >= -1).all()
    single = kernel_windows(_pieces(single_rows=True))
    assert (single[:, 2] == 0).all() and (single[:, 1] == -1).all()  # one row: right = 0 keeps FA2 from swapping


def test_lse_conversions_both_layouts_and_gqa_swap():
    p = Pieces([0, 4, 6], [3, 1, 2], [0, 0, 0], [5, 5, 5], False)
    pk = Packed(p, "cpu")
    heads, total = 4, 6
    rows = torch.arange(total * heads, dtype=torch.float32).reshape(total, heads)
    unpadded = rows.t().contiguous()
    assert torch.equal(pk.lse_from_kernel(unpadded, heads), rows)
    padded = pk.lse_to_kernel(rows, like_padded=True)
    assert padded.shape == (3, heads, 3)
    assert torch.equal(pk.lse_from_kernel(padded, heads), rows)
    assert torch.equal(pk.lse_to_kernel(rows, like_padded=False), unpadded)
    # max_q == 1 GQA swap: B rows, groups g: the kernel's [Hkv, B, g] buffer viewed as [H, B]
    single = Packed(Pieces([0, 1, 2], [1, 1, 1], [0, 0, 0], [5, 5, 5], False), "cpu")
    rows1 = torch.arange(3 * heads, dtype=torch.float32).reshape(3, heads)  # [B, H], head h = hk * g + gi
    kernel_buf = rows1.reshape(3, 2, 2).permute(1, 0, 2).reshape(heads, 3)  # [Hkv, B, g] memory as [H, B]
    assert torch.equal(single.lse_from_kernel(kernel_buf, heads, kv_heads=2, swapped=True), rows1)
    with pytest.raises(RuntimeError, match="softmax_lse shape"):
        pk.lse_from_kernel(torch.zeros(5, 5), heads)


def test_selection_is_honest_and_logged_once(caplog):
    q = torch.zeros(4, 2, 64, dtype=torch.float64)
    sel._LOGGED.clear()
    with caplog.at_level(logging.INFO, logger="attention.backends.select"):
        for _ in range(3):
            assert get_backend("auto", q, q).name == "torch"
            assert get_backend("auto", q, q, softcap=True).name == "torch"
    assert len(caplog.records) == 2  # one line per cause (plain, softcap), not per call
    with pytest.raises(ValueError, match="not installed|CUDA"):
        get_backend("flash_attn3", q, q)
    assert "CUDA tensors only" in _backend("2.7.4").why_not(q, q)


def test_layout_pieces_device_tensors_cached():
    """Index tensors are built once per (pieces, device): a second call reuses them (no host-to-device copy)."""
    b = _backend("2.7.4")
    p = _pieces()
    first = b._calls(p, torch.device("cpu"))
    assert b._calls(p, torch.device("cpu")) is first
    assert np.all([isinstance(c[0], Packed) for c in first[0]]) and first[1] is None


def test_tall_two_sided_window_blocks_stay_exact():
    """flash-attn widens a right window >= max_seqlen_k to unbounded: such blocks (more queries than keys, the
    first rows not seeing the last key) must not reach the kernel."""
    b = _backend("2.7.4")
    tall = Pieces([0, 10], [8, 4], [0, 5], [3, 4], False, [-1, 0], [UNBOUNDED, UNBOUNDED])
    assert kernel_windows(tall)[0, 2] >= 3
    CALLS.clear()
    _check(b, tall)
    assert len(CALLS) == 2  # the square causal block went to the kernel (fwd + bwd), the tall one did not


def test_comm_device_follows_the_per_device_backend():
    from attention._dist import comm_device

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert comm_device("cpu:gloo,cuda:nccl", cuda) == cuda  # CUDA tensors over NCCL, not staged through the host
    assert comm_device("cpu:gloo,cuda:nccl", cpu) == cpu
    assert comm_device("nccl", cuda) == cuda
    assert comm_device("gloo", cuda) == cpu  # gloo moves host tensors: CUDA K/V is staged
    assert comm_device("cpu:gloo", cuda) == cpu


def _broken_flash_attn(root, message: str):
    """A flash_attn package on ``root`` whose kernel module fails to import (like a CUDA extension built for
    another torch)."""
    pkg = root / "flash_attn"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "flash_attn_interface.py").write_text(f"raise ImportError({message!r})\n")


def test_broken_flash_attn_is_logged_with_its_exception(tmp_path, monkeypatch, caplog):
    """An installed flash-attn whose import raises: a warning carrying the exception, and the backend's refusal
    (ValueError of get_backend) names it; a package that is not installed stays quiet (debug only)."""
    import sys

    message = "libcudart.so.12: cannot open shared object file"
    _broken_flash_attn(tmp_path, message)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("flash_attn", "flash_attn.flash_attn_interface"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.delitem(sel._LAZY, "flash_attn", raising=False)
    with caplog.at_level(logging.DEBUG, logger="attention.backends.flash"):
        backend = FlashAttnBackend()
        not_installed = FlashAttn3Backend()
    assert not backend.available() and message in backend.problem and "installed" in backend.problem
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "flash_attn.flash_attn_interface" in warnings[0].getMessage()
    assert isinstance(warnings[0].exc_info[1], ImportError) and message in str(warnings[0].exc_info[1])
    assert not_installed.problem == "flash_attn3 is not installed"
    assert all(r.levelno == logging.DEBUG for r in caplog.records if "flash_attn_interface is not" in r.getMessage())
    q = torch.zeros(4, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="import failed: ImportError: libcudart"):
        get_backend("flash_attn", q, q)
