"""CUDA paths (skipped without a GPU): the torch backend (PyTorch's varlen flash kernel) and, when installed, the
flash_attn backend, against the float64 reference on CPU; cp_attention with CUDA tensors over gloo (host-staged)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _attn_ref import reference

from attention import get_backend, varlen_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
TOL_GRAD = {torch.bfloat16: 2e-2, torch.float16: 5e-3}


def _flash_available() -> bool:
    q = torch.zeros(1, 2, 64, device="cuda", dtype=torch.bfloat16)
    try:
        return get_backend("flash_attn", q, q[:, :1]).name == "flash_attn"
    except ValueError:
        return False


def _check(backend, dtype, causal, chunk_size=None, lens=(1, 7, 130, 64, 3, 257), heads=(8, 2), dim=64):
    gen = torch.Generator().manual_seed(0)
    cu = np.concatenate([[0], np.cumsum(lens)])
    T = int(cu[-1])
    q, k, v = (
        torch.randn(T, h, dim, generator=gen, dtype=torch.float64).to(dtype) for h in (heads[0], heads[1], heads[1])
    )
    dout = torch.randn(T, heads[0], dim, generator=gen, dtype=torch.float64)
    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    ref = reference(qr, kr, vr, cu, causal, dim**-0.5)
    ref_g = torch.autograd.grad(ref, (qr, kr, vr), dout)
    qc, kc, vc = (x.cuda().requires_grad_() for x in (q, k, v))
    out = varlen_attention(
        qc, kc, vc, torch.from_numpy(cu).int().cuda(), causal=causal, backend=backend, chunk_size=chunk_size
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
def test_flash_attn_backend(dtype, causal):
    if not _flash_available():
        pytest.skip("flash-attn is not installed")
    _check("flash_attn", dtype, causal)
    _check("flash_attn", dtype, causal, chunk_size=48)


def test_auto_backend_on_cuda():
    q = torch.zeros(4, 2, 64, device="cuda", dtype=torch.bfloat16)
    assert get_backend("auto", q, q).name == ("flash_attn" if _flash_available() else "torch")
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
    for method in ("ring", "allgather"):
        ql, kl, vl = (lay.shard(x, rank).cuda().requires_grad_() for x in (q, k, v))
        out = cp_attention(ql, kl, vl, lay, causal=True, method=method)
        g = torch.autograd.grad(out, (ql, kl, vl), lay.shard(dout, rank).to(torch.bfloat16).cuda())
        assert rel(out.cpu(), lay.shard(ref, rank), float(ref.abs().max())) <= 1e-2
        for a, b in zip(g, ref_g):
            assert rel(a.cpu(), lay.shard(b, rank), max(float(b.abs().max()), float(ref_g[2].abs().max()))) <= 2e-2
    dist.barrier()


def test_cp_attention_cuda_tensors_over_gloo():
    from _dist_utils import run_world

    run_world(2, _worker_cuda)
