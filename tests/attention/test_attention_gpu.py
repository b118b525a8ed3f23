"""CUDA paths (skipped without a GPU): the torch backend (PyTorch's varlen flash kernel) and, when installed, the
flash_attn / flash_attn3 backends, against the float64 reference on CPU: bf16/fp16, causal and full, sliding windows
(left only, left + right), softcap where the kernel takes it, GQA, blocks taller than their keys (the case the
kernels' window mapping misreads unless split), every CP schedule (ring, all-gather, Ulysses; zigzag, contiguous,
hybrid; W = 2, 3, 4) simulated on the device; cp_attention with CUDA tensors over gloo (host-staged)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.attn_ref import reference

from attention import get_backend, varlen_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
TOL_GRAD = {torch.bfloat16: 2e-2, torch.float16: 5e-3}


def _flash_available(name: str = "flash_attn") -> bool:
    q = torch.zeros(1, 2, 64, device="cuda", dtype=torch.bfloat16)
    try:
        return get_backend(name, q, q[:, :1]).name == name
    except ValueError:
        return False


def _check(backend, dtype, causal, chunk_size=None, lens=(1, 7, 130, 64, 3, 257), heads=(8, 2), dim=64, window=(-1, -1),
           softcap=0.0):  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    cu = np.concatenate([[0], np.cumsum(lens)])
    T = int(cu[-1])
    q, k, v = (
        torch.randn(T, h, dim, generator=gen, dtype=torch.float64).to(dtype) for h in (heads[0], heads[1], heads[1])
    )
    dout = torch.randn(T, heads[0], dim, generator=gen, dtype=torch.float64)
    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    ref = reference(qr, kr, vr, cu, causal, dim**-0.5, window, softcap)
    ref_g = torch.autograd.grad(ref, (qr, kr, vr), dout)
    qc, kc, vc = (x.cuda().requires_grad_() for x in (q, k, v))
    out = varlen_attention(
        qc, kc, vc, torch.from_numpy(cu).int().cuda(), causal, None, backend, chunk_size, window, softcap
    )
    grads = torch.autograd.grad(out, (qc, kc, vc), dout.to(dtype).cuda())
    assert float((out.double().cpu() - ref).abs().max()) <= TOL[dtype] * float(ref.abs().max())
    scale = float(ref_g[2].abs().max())
    for g, rg in zip(grads, ref_g):
        assert float((g.double().cpu() - rg).abs().max()) <= TOL_GRAD[dtype] * max(float(rg.abs().max()), scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("chunk_size", [None, 48])
def test_torch_backend_cuda(dtype, causal, chunk_size):
    _check("torch", dtype, causal, chunk_size)
    qz = torch.zeros(1, 2, 64, device="cuda", dtype=dtype)
    if get_backend("torch", qz, qz).has_window:
        _check("torch", dtype, causal, chunk_size, window=(40, -1 if causal else 9))


@pytest.mark.parametrize("name", ["flash_attn", "flash_attn3"])
def test_flash_packages_masks(name):
    if not _flash_available(name):
        pytest.skip(f"{name} is not installed or not supported on this device")
    for causal, window, softcap in ((True, (40, -1), 0.0), (False, (9, 21), 0.0), (True, (-1, -1), 3.0)):
        _check(name, torch.bfloat16, causal, window=window, softcap=softcap)
        _check(name, torch.bfloat16, causal, chunk_size=48, window=window, softcap=softcap)


def _fused_backends() -> list[str]:
    q = torch.zeros(1, 2, 64, device="cuda", dtype=torch.bfloat16)
    names = []
    for name in ("torch", "flash_attn", "flash_attn3"):
        try:
            get_backend(name, q, q[:, :1], window=True)
            names.append(name)
        except ValueError:
            continue
    return names


@pytest.mark.parametrize("method", ["ring", "allgather", "ulysses"])
def test_simulated_schedules_bf16(method):
    """Every method's kernel sequence (all CP ranks in this process) on the GPU equals the float64 reference, with
    windows on every layout kind: zigzag gives rank W-1 blocks twice as tall as their keys, the shape flash-attn 2's
    and PyTorch's window mapping misreads (right -1 -> max_seqlen_k) unless the block is split."""
    from support.attn_ref import reference as ref_fn

    from attention.simulate import simulate

    lens = (1, 7, 130, 64, 3, 257, 600)
    cu = np.concatenate([[0], np.cumsum(lens)])
    gen = torch.Generator().manual_seed(0)
    t = int(cu[-1])
    q64, k64, v64, d64 = (torch.randn(t, h, 64, generator=gen, dtype=torch.float64) for h in (8, 2, 2, 8))
    q, k, v, dout = (x.to(torch.bfloat16) for x in (q64, k64, v64, d64))
    cases = [(True, (-1, -1), "zigzag"), (True, (100, -1), "zigzag"), (False, (70, 30), "contiguous"),
             (True, (300, -1), "hybrid")]  # fmt: skip
    for name in _fused_backends():
        for causal, window, kind in cases:
            x = [a.double().requires_grad_() for a in (q, k, v)]
            ref = ref_fn(*x, cu, causal, 0.125, window)
            ref_g = torch.autograd.grad(ref, x, dout.double())
            for world in (2, 3, 4):
                if method == "ulysses" and 8 % world:
                    continue
                out, grads = simulate(q.cuda(), k.cuda(), v.cuda(), cu, world, method, kind, causal, 0.125, window,
                                      backend=name, dout=dout.cuda())  # fmt: skip
                where = f"{name} {kind} W={world} window={window}"
                scale = float(ref.abs().max())
                assert float((out.double().cpu() - ref.detach()).abs().max()) <= 1e-2 * scale, where
                gs = float(ref_g[2].abs().max())
                for g, rg in zip(grads, ref_g):
                    err = float((g.double().cpu() - rg).abs().max())
                    assert err <= 2e-2 * max(float(rg.abs().max()), gs), where


def test_tall_windowed_blocks_on_the_kernels():
    """Blocks with more queries than keys + 1 under a left window and no right bound, and under a two-sided
    window, straight through each fused backend's driver, against the reference backend in float64."""
    from attention import Pieces
    from attention.backends import UNBOUNDED, ReferenceBackend

    p = Pieces([0, 300, 700], [256, 300, 200], [0, 100, 400], [64, 40, 30], False, [-63, -39, -10],
               [UNBOUNDED, 200, 190])  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(900, 8, 64, generator=gen, dtype=torch.float64).bfloat16().double()  # the kernels' inputs
    k, v = (torch.randn(500, 2, 64, generator=gen, dtype=torch.float64).bfloat16().double() for _ in range(2))
    ref_out, ref_lse = ReferenceBackend().forward(q, k, v, p, 0.125)
    for name in _fused_backends():
        qc, kc, vc = (x.to("cuda", torch.bfloat16) for x in (q, k, v))
        out, lse = get_backend(name, qc, kc, window=True).forward(qc, kc, vc, p, 0.125)
        fin = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse.cpu()), fin), name
        assert float((out.double().cpu() - ref_out).abs().max()) <= 2e-2 * float(ref_out.abs().max()), name
        assert float((lse.double().cpu()[fin] - ref_lse[fin]).abs().max()) <= 1e-2, name


def test_reference_refused_for_long_documents_on_cuda():
    q = torch.zeros(8, 2, 64, device="cuda", dtype=torch.float32)  # fp32: no fused CUDA kernel
    assert get_backend("auto", q, q, max_len=1024).name == "reference"
    with pytest.raises(ValueError, match="materialise"):
        get_backend("auto", q, q, max_len=1 << 15)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
def test_flash_attn_backend(dtype, causal):
    if not _flash_available():
        pytest.skip("flash-attn is not installed")
    _check("flash_attn", dtype, causal)
    _check("flash_attn", dtype, causal, chunk_size=48)


def test_auto_backend_on_cuda():
    q = torch.zeros(4, 2, 64, device="cuda", dtype=torch.bfloat16)
    want = "flash_attn3" if _flash_available("flash_attn3") else "flash_attn" if _flash_available() else "torch"
    assert get_backend("auto", q, q).name == want
    q32 = q.float()
    assert get_backend("auto", q32, q32).name == "reference"  # fp32 on CUDA: no fused varlen kernel


def _worker_cuda(rank, world):
    import torch.distributed as dist
    from test_attention_cp import reference as ref_cp
    from test_attention_cp import rel

    from attention import CPLayout, cp_attention

    lens = np.array([5, 1, 40, 3, 17])
    cu = np.concatenate([[0], np.cumsum(lens)])
    gen = torch.Generator().manual_seed(0)
    T = int(cu[-1])
    q, k, v = (torch.randn(T, h, 64, generator=gen, dtype=torch.float64).to(torch.bfloat16) for h in (4, 2, 2))
    dout = torch.randn(T, 4, 64, generator=gen, dtype=torch.float64)
    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    ref = ref_cp(qr, kr, vr, cu, True, 0.125)
    ref_g = torch.autograd.grad(ref, (qr, kr, vr), dout)
    lay = CPLayout.build(cu, world)
    for method in ("ring", "allgather", "ulysses"):
        ql, kl, vl = (lay.shard(x, rank).cuda().requires_grad_() for x in (q, k, v))
        out = cp_attention(ql, kl, vl, lay, causal=True, method=method)
        g = torch.autograd.grad(out, (ql, kl, vl), lay.shard(dout, rank).to(torch.bfloat16).cuda())
        assert rel(out.cpu(), lay.shard(ref, rank), float(ref.abs().max())) <= 1e-2
        for a, b in zip(g, ref_g):
            assert rel(a.cpu(), lay.shard(b, rank), max(float(b.abs().max()), float(ref_g[2].abs().max()))) <= 2e-2
    dist.barrier()


def test_cp_attention_cuda_tensors_over_gloo():
    from support.dist import run_world

    run_world(2, _worker_cuda)
