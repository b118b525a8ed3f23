"""The CUDA kernels' glue, on CPU: the flash-attn argument adapters fed the recorded signatures of flash-attn 2.5.0,
2.5.9, 2.6.3, 2.7.4, 2.8.3, flash-attn 3 (2024 beta, 2025, custom ops) and PyTorch's flash ops (stand-ins computing
with the kernels' C++ rules, support.flash_signatures), end to end through the varlen driver (mask grouping,
bottom-right windows, tall-block splitting, lse layouts, backward) against the reference backend; bindings refused
at detection naming the parameter; lse conversions for both layouts and the max_q == 1 GQA swap; honest detection
and selection; the CPU backend's logged routing to the reference kernel."""

from __future__ import annotations

import inspect
import logging

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.flash_signatures import CALLS, FA3_VERSIONS, STATE, TORCH_OPS, VERSIONS

from attention import Pieces
from attention.backends import (
    UNBOUNDED,
    ArgAdapter,
    FlashAttn3Backend,
    FlashAttnBackend,
    Packed,
    ReferenceBackend,
    TorchCUDABackend,
    get_backend,
    kernel_windows,
    report,
    signature_params,
    split_tall,
)
from attention.backends import select as sel

SOFTCAP = {"2.6.3", "2.7.4", "2.8.3", "fa3-2025", "fa3-op"}


def _backend(version):
    cls = FlashAttn3Backend if version in FA3_VERSIONS else FlashAttnBackend
    b = cls(functions=VERSIONS[version][:2])
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
        assert (a.double() - b).abs().max() <= 2e-6 * max(1.0, float(b.abs().max()))  # the kernels take a float32 lse


@pytest.mark.parametrize("version", list(VERSIONS))
@pytest.mark.parametrize("padded", [False, True])
def test_flash_adapters_end_to_end(version, padded):
    if version in FA3_VERSIONS and padded:
        pytest.skip("flash-attn 3 returns the unpadded layout only")
    STATE["padded"] = padded
    type(_backend(version))._lse_padded = None
    try:
        b = _backend(version)
        softcap = 1.5 if version in SOFTCAP else 0.0
        assert b.has_window and b.has_softcap == (version in SOFTCAP)
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
    assert "softcap" in b.why_not(q, q, softcap=True)  # the mask is checked before the device
    assert "CUDA tensors only" in b.why_not(q, q)
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
    _check(_backend("fa3-op"), Pieces([0], [6], [0], [6], True))
    assert [c["causal"] for c in CALLS] == [True, True]


def test_unfillable_parameter_is_refused_at_detection():
    """A parameter without default that the project cannot fill makes the backend unavailable when it is built,
    naming the parameter (so ``auto`` moves on), instead of raising at the first forward."""

    def fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, mystery):
        raise AssertionError("must not be called")

    b = FlashAttn3Backend(functions=(fwd, VERSIONS["fa3-op"][1]))
    assert not b.available() and "'mystery'" in b.problem
    # flash-attn 3 of 2025 has about 25 parameters without defaults: every one gets a neutral value
    old = FlashAttn3Backend(functions=VERSIONS["fa3-2025"][:2])
    assert old.available() and old.fwd_adapter.window_style == "tuple", old.problem
    required = [n for n, p in signature_params(VERSIONS["fa3-2025"][0]).items() if p.default is p.empty]
    assert len(required) == 25 and "k_new" in required and "out" in required


def test_torch_flash_op_bindings():
    """PyTorch's flash ops bound by schema names: this torch's real schema, 2.13's recorded one (windows), one
    without windows (old philox names), one with an argument nothing fills (refused, named)."""
    real = TorchCUDABackend()
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    assert real.problem == "" and real.has_window == ((major, minor) >= (2, 5))
    b = TorchCUDABackend(ops=TORCH_OPS["torch-2.13"])
    assert b.available() and b.has_window and not b.has_softcap
    CALLS.clear()
    _check(b, _pieces())
    assert {c["version"] for c in CALLS} == {"torch-2.13"}
    nw = TorchCUDABackend(ops=TORCH_OPS["torch-nowindow"])
    q = torch.zeros(4, 2, 64)
    assert nw.available() and not nw.has_window and "sliding window" in nw.why_not(q, q, window=True)
    _check(nw, Pieces([0, 5], [5, 6], [0, 5], [5, 6], [True, False]))
    bad = TorchCUDABackend(ops=TORCH_OPS["torch-unfillable"])
    assert not bad.available() and "'sink_scale'" in bad.why_not(q, q)


def test_real_torch_flash_op_accepts_the_bound_arguments():
    """The arguments bound for this PyTorch's own aten ops parse against their schemas: on a CPU-only build the
    call reaches the dispatcher, which has no CPU kernel (NotImplementedError), not a schema mismatch."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA build runs these ops in tests/attention/test_attention_gpu.py")
    b = TorchCUDABackend()
    p = Pieces([0], [4], [0], [4], False, [-1], [2])
    pk = Packed(p, "cpu")
    q = torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="_flash_attention_forward"):
        b._kfwd(q, q, q, pk, False, (2, 1), 0.0, 0.125)
    lse = torch.zeros(2, 4)
    with pytest.raises(NotImplementedError, match="_flash_attention_backward"):
        b._kbwd(q, q, q, q, q, lse, pk, False, (2, 1), 0.0, 0.125)


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
    assert "is_causal" in inspect.signature(VERSIONS["fa3-op"][1]).parameters and "k_new" in names["fa3-op"]
    assert "block_table" not in names["2.5.0"] and "block_table" in names["2.5.9"]
    assert "zero_tensors" in names["2.7.4"] and "window_size" in names["fa3-2025"] and "out" in names["fa3-2025"]
    assert "cu_seqlens_q" in names["fa3-2024"] and "window_size" in names["fa3-2024"]


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
    assert np.all([isinstance(c[0], Packed) for c in first])


@pytest.mark.parametrize("version", ["2.7.4", "fa3-2024", "fa3-op"])
def test_tall_windowed_blocks_are_split_and_exact(version):
    """flash-attn 2 maps a right window of -1 (with a bounded left one) or one >= max_seqlen_k to max_seqlen_k;
    blocks with more queries than keys + 1 are split so that no row's keys change, and every call stays fused."""
    b = _backend(version)
    tall = Pieces([0, 10, 20], [8, 4, 9], [0, 5, 3], [3, 4, 2], False, [-1, 0, -1], [UNBOUNDED, UNBOUNDED, 6])
    split = split_tall(tall)
    assert split.pairs() == tall.pairs() and (split.q_len <= split.k_len + 1).all()
    CALLS.clear()
    _check(b, tall)
    assert CALLS and sum(c["changed_rows"] for c in CALLS if c["kind"] == "fwd") == 0


@settings(max_examples=60, deadline=None)
@given(
    ql=st.integers(1, 40), kl=st.integers(1, 12), lo=st.integers(-12, 0), hi=st.one_of(st.integers(0, 50),
                                                                                       st.just(UNBOUNDED)))  # fmt: skip
def test_split_tall_keeps_every_pair(ql, kl, lo, hi):
    p = Pieces([3], [ql], [7], [kl], False, [lo], [hi])
    s = split_tall(p)
    assert s.pairs() == p.pairs()
    assert not (s.banded & (s.q_len > s.k_len + 1)).any()
    ends = s.q_start + s.q_len
    assert (s.q_start[1:] >= ends[:-1]).all()  # query ranges stay disjoint


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

    message = "libcudart.so.12: cannot open shared object file"
    _broken_flash_attn(tmp_path, message)
    _fresh(monkeypatch, tmp_path, ("flash_attn", "flash_attn.flash_attn_interface"))
    monkeypatch.setattr(sel, "_LAZY", {})
    with caplog.at_level(logging.DEBUG, logger="attention.backends.flash"):
        backend = FlashAttnBackend()
        not_installed = FlashAttn3Backend()
    assert not backend.available() and message in backend.problem and "installed" in backend.problem
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "flash_attn.flash_attn_interface" in warnings[0].getMessage()
    assert message in warnings[0].getMessage() and warnings[0].exc_info is None  # one line, no traceback
    assert backend.installed and not not_installed.installed
    assert not_installed.problem == "flash_attn3 is not installed"
    assert all(r.levelno == logging.DEBUG for r in caplog.records if "flash_attn_interface is not" in r.getMessage())
    q = torch.zeros(4, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="import failed: ImportError: libcudart"):
        get_backend("flash_attn", q, q)


def _package(root, files: dict) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _fresh(monkeypatch, root, names):
    """``root`` on sys.path and ``names`` absent from sys.modules during the test, and again after it (modules the
    test imports from ``root`` must not leak into later tests)."""
    import sys

    monkeypatch.syspath_prepend(str(root))
    for name in names:
        monkeypatch.setitem(sys.modules, name, None)
        del sys.modules[name]


def test_installed_without_the_functions_is_not_reported_as_absent(tmp_path, monkeypatch, caplog):
    """A flash-attn that imports but lacks the varlen functions: rejected with that reason (one WARNING), never
    "not installed"."""
    _package(tmp_path, {"flash_attn/__init__.py": "", "flash_attn/flash_attn_interface.py": "X = 1\n"})
    _fresh(monkeypatch, tmp_path, ("flash_attn", "flash_attn.flash_attn_interface"))
    with caplog.at_level(logging.DEBUG, logger="attention.backends.flash"):
        b = FlashAttnBackend()
    assert b.installed and not b.available() and "has none of" in b.problem and "not installed" not in b.problem
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1


def test_working_fa3_prints_nothing_for_its_missing_alternative(tmp_path, monkeypatch, caplog):
    """flash-attn 3 installed as ``flash_attn_interface`` next to a ``flash_attn_3`` package without that
    submodule: bound, and no warning or traceback about the alternative module."""
    code = (
        "from support.flash_signatures import fwd_fa3_op as _flash_attn_forward\n"
        "from support.flash_signatures import bwd_fa3_op as _flash_attn_backward\n"
    )
    _package(tmp_path, {"flash_attn_interface.py": code, "flash_attn_3/__init__.py": ""})
    _fresh(monkeypatch, tmp_path, ("flash_attn_interface", "flash_attn_3", "flash_attn_3.flash_attn_interface"))
    with caplog.at_level(logging.DEBUG, logger="attention.backends.flash"):
        b = FlashAttn3Backend()
    assert b.available() and b.source == "flash_attn_interface._flash_attn_forward", b.problem
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]


def test_report_says_what_is_installed_and_chosen(monkeypatch):
    monkeypatch.setattr(sel, "_LAZY", {})  # built afresh from what this environment holds
    text = report("cpu", head_dim=64)
    assert "flash_attn3: not installed" in text and "flash_attn: not installed" in text
    assert "auto on cpu" in text and "sliding window: torch" in text
    assert "torch [CPU]" in text and "reference kernel" in text


def test_cpu_backend_names_its_reference_routing_once(caplog):
    """Windowed and soft-capped blocks on the CPU backend run on the reference kernel: a WARNING, once per cause,
    with backend="torch" as with "auto"."""
    from attention import varlen_attention
    from attention.backends import torch_cpu

    torch_cpu._ROUTED.clear()
    q = torch.randn(12, 2, 8, dtype=torch.float64)
    with caplog.at_level(logging.WARNING, logger="attention.backends.torch_cpu"):
        for backend in ("torch", "auto", "torch"):
            varlen_attention(q, q, q, [0, 5, 12], window_size=(2, -1), backend=backend)
            varlen_attention(q, q, q, [0, 5, 12], softcap=3.0, backend=backend)
        varlen_attention(q, q, q, [0, 5, 12], backend="torch")  # plain causal: fused, nothing logged
    msgs = [r.getMessage() for r in caplog.records if r.name == "attention.backends.torch_cpu"]
    assert len(msgs) == 2 and "sliding-window" in msgs[0] and "soft-capped" in msgs[1]


def test_cli_prints_the_report(capsys, monkeypatch):
    from balancer.cli import main

    monkeypatch.setattr(sel, "_LAZY", {})
    assert main(["backends", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "auto on cpu" in out and "flash_attn: not installed" in out
    assert main(["backends", "--device", "bogus"]) == 2
    assert "--device must be" in capsys.readouterr().err
