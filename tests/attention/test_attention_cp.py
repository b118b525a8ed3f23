"""cp_attention (ring and all-gather) on real gloo worlds of 2, 3 and 4 spawned processes, forward and all three
gradients against a plain float64 masked-softmax reference; error cases fail on every rank."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
from support.attn_ref import reference
from support.dist import run_world

from attention import CPLayout, cp_attention, varlen_attention

pytestmark = pytest.mark.slow  # multi-process gloo

TOL = {
    torch.float64: 1e-9,
    torch.float32: 2e-5,
    # bf16: inputs are bf16 on both sides (the reference sees the same rounded values in float64), so what is
    # left is kernel arithmetic: each block's output / gradient is rounded to bf16 once (unit roundoff 2^-8 =
    # 3.9e-3 relative to its scale) and probabilities are rounded to bf16 inside the kernel before P@V; blocks
    # merge in float32, which adds no error of that size. Two roundings ~ 7.8e-3 -> 1e-2 for the output; the
    # gradients pass through one more bf16 product (dS = P*(dP-D)) -> 2e-2.
    torch.bfloat16: 1e-2,
}
TOL_GRAD = {torch.float64: 1e-9, torch.float32: 2e-5, torch.bfloat16: 2e-2}


def rel(a, b, scale=None) -> float:
    """max |a - b| relative to ``scale`` (default: max |b|); 0 for empty shards."""
    a, b = a.detach(), b.detach()
    if b.numel() == 0:
        assert a.numel() == 0
        return 0.0
    scale = float(b.double().abs().max()) if scale is None else scale
    return float((a.double() - b.double()).abs().max()) / max(scale, 1e-300)


def random_lengths(rng, world, max_len=60):
    n = int(rng.integers(1, 8))
    lens = rng.integers(1, max_len, size=n)
    specials = [1, 3, 2 * world - 1, 2 * world + 1]
    lens[rng.integers(0, n)] = specials[int(rng.integers(0, len(specials)))]
    return lens


def check_case(
    rank,
    world,
    lens,
    heads,
    kv_heads,
    dim,
    dtype,
    causal,
    method,
    kind="zigzag",
    backend="auto",
    group=None,
    head_chunks=1,
    seed=0,
    layout_opts=None,
    window=(-1, -1),
    softcap=0.0,
):
    """One case: build the same global problem on every rank, run cp_attention on this rank's shard, compare the
    local output and local dq/dk/dv with the same rows of the float64 reference."""
    gen = torch.Generator().manual_seed(seed)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    T = int(cu[-1])
    q = torch.randn(T, heads, dim, generator=gen, dtype=torch.float64).to(dtype)
    k = torch.randn(T, kv_heads, dim, generator=gen, dtype=torch.float64).to(dtype)
    v = torch.randn(T, kv_heads, dim, generator=gen, dtype=torch.float64).to(dtype)
    dout = torch.randn(T, heads, dim, generator=gen, dtype=torch.float64)
    scale = 0.5 / math.sqrt(dim)
    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))  # reference sees the same rounded inputs
    ref = reference(qr, kr, vr, cu, causal, scale, window, softcap)
    ref_g = torch.autograd.grad(ref, (qr, kr, vr), dout)

    cp = dist.get_world_size(group)
    r = dist.get_rank(group)
    layout = CPLayout.build(cu, cp, kind=kind, **(layout_opts or {}))
    ql, kl, vl = (layout.shard(x, r).requires_grad_() for x in (q, k, v))
    out = cp_attention(
        ql,
        kl,
        vl,
        layout,
        group=group,
        causal=causal,
        softmax_scale=scale,
        method=method,
        backend=backend,
        head_chunks=head_chunks,
        window_size=window,
        softcap=softcap,
    )
    assert out.dtype == dtype and out.shape == ql.shape
    grads = torch.autograd.grad(out, (ql, kl, vl), layout.shard(dout, r).to(dtype))
    what = f"rank {rank} lens {lens.tolist()} H {heads}/{kv_heads} {dtype} causal {causal} {method} {kind}"
    # errors relative to the scale of the whole global tensor; gradients: floored at max |dv| (the scale dout sets),
    # since dq and dk vanish exactly when every document has one token
    e = rel(out, layout.shard(ref, r), float(ref.detach().abs().max()))
    assert e <= TOL[dtype], (what, "out", e)
    dv_scale = float(ref_g[2].abs().max())
    for name, g, rg in zip("qkv", grads, ref_g):
        e = rel(g, layout.shard(rg, r), max(float(rg.abs().max()), dv_scale))
        assert e <= TOL_GRAD[dtype], (what, "d" + name, e)
    return out


def _worker_cases(rank, world):
    rng = np.random.default_rng(1000 + world)
    n = 0
    for case in range(10):
        lens = random_lengths(rng, world)
        heads, kv_heads = [(2, 2), (4, 2), (4, 1), (6, 3)][case % 4]
        dim = [8, 16][case % 2]
        for dtype in (torch.float64, torch.float32):
            for causal in (True, False):
                for method in ("ring", "allgather"):
                    check_case(
                        rank,
                        world,
                        lens,
                        heads,
                        kv_heads,
                        dim,
                        dtype,
                        causal,
                        method,
                        head_chunks=1 + case % 2,
                        seed=case,
                    )
                    n += 1
    # bf16 (the CPU kernel in bf16), the reference backend, the contiguous layout
    for case in range(3):
        lens = random_lengths(rng, world)
        for method in ("ring", "allgather"):
            check_case(rank, world, lens, 4, 2, 16, torch.bfloat16, True, method, seed=case)
            check_case(rank, world, lens, 4, 2, 8, torch.float64, True, method, backend="reference", seed=case)
            check_case(rank, world, lens, 2, 1, 8, torch.float64, case % 2 == 0, method, kind="contiguous", seed=case)
            n += 3
    # documents shorter than the group (some ranks hold nothing of them, or nothing at all)
    for lens in (np.array([1]), np.array([3]), np.array([1, 1, 2]), np.array([2 * world, 1])):
        for method in ("ring", "allgather"):
            check_case(rank, world, lens, 2, 1, 8, torch.float64, True, method)
            n += 1
    assert n > 90


def _expect_error(fn, match: str):
    try:
        fn()
    except ValueError as e:
        assert match in str(e), (match, str(e))
        return
    raise AssertionError(f"no ValueError (wanted {match!r})")


def _worker_errors(rank, world):
    lens = np.array([5, 9, 2])
    cu = np.concatenate([[0], np.cumsum(lens)])
    lay = CPLayout.build(cu, world)
    T = lay.num_local_tokens(rank)
    q, k = torch.randn(T, 4, 8), torch.randn(T, 2, 8)
    _expect_error(lambda: cp_attention(q, k, k, CPLayout.build(cu, world + 1)), "process group has")
    _expect_error(lambda: cp_attention(q, k, k, lay, method="bogus"), "method")
    # one rank passes the wrong number of rows: every rank raises
    qq = torch.randn(T + 1, 4, 8) if rank == 0 else q
    _expect_error(lambda: cp_attention(qq, k, k, lay), "invalid inputs" if rank else "holds")
    _expect_error(lambda: cp_attention(q, k.double(), k.double(), lay), "dtypes differ")
    _expect_error(lambda: cp_attention(q, torch.randn(T, 2, 4), torch.randn(T, 2, 4), lay), "head_dim")
    _expect_error(lambda: cp_attention(torch.randn(T, 3, 8), k, k, lay), "multiple of num kv heads")
    # ranks disagree on dtype, on the layout, on causal
    qd, kd = (q.double(), k.double()) if rank == 0 else (q, k)
    _expect_error(lambda: cp_attention(qd, kd, kd, lay), "disagree")
    lay2 = CPLayout.build(np.array([0, 16]), world) if rank == 0 else lay
    T2 = lay2.num_local_tokens(rank)
    _expect_error(
        lambda: cp_attention(torch.randn(T2, 4, 8), torch.randn(T2, 2, 8), torch.randn(T2, 2, 8), lay2), "disagree"
    )
    _expect_error(lambda: cp_attention(q, k, k, lay, causal=rank == 0), "disagree")
    # the group still works after the errors
    check_case(rank, world, lens, 4, 2, 8, torch.float64, True, "ring")


def _worker_subgroups(rank, world):
    """world 4 as two CP groups of 2 (global ranks differ from group ranks), each with its own problem."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    lens = np.array([7, 1, 12]) if rank < 2 else np.array([3, 30])
    for method in ("ring", "allgather"):
        check_case(rank, world, lens, 4, 2, 8, torch.float64, True, method, group=mine)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_cp_attention_matches_reference(world):
    run_world(world, _worker_cases)


def test_cp_attention_errors_fail_on_every_rank():
    run_world(3, _worker_errors)


def test_cp_attention_on_subgroups():
    run_world(4, _worker_subgroups)


def test_cp_layout_single_rank_equals_varlen():
    """cp_size 1 needs no process group semantics beyond a world of one: compare with varlen_attention."""
    run_world(1, _worker_single)


def _worker_single(rank, world):
    lens = np.array([4, 1, 33])
    for causal in (True, False):
        out = check_case(rank, world, lens, 4, 2, 8, torch.float64, causal, "ring")
        cu = np.concatenate([[0], np.cumsum(lens)])
        gen = torch.Generator().manual_seed(0)
        T = int(cu[-1])
        q = torch.randn(T, 4, 8, generator=gen, dtype=torch.float64)
        k = torch.randn(T, 2, 8, generator=gen, dtype=torch.float64)
        v = torch.randn(T, 2, 8, generator=gen, dtype=torch.float64)
        ref = varlen_attention(q, k, v, cu, causal=causal, softmax_scale=0.5 / math.sqrt(8))
        assert rel(out, ref) <= 1e-12
