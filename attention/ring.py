"""Ring attention: each rank first attends its own K/V locally, while the travelling K/V (the split documents' rows:
all of them in zigzag/contiguous, none of the whole documents in hybrid) rotate around the CP group by P2P
(``batch_isend_irecv``), the next transfer posted before the current block is computed; partial results merge in
float32 with the log-sum-exp. The backward rotates the travelling K/V again and circulates their dK/dV in float32
behind them, the last hop returning each block's gradient to its owner. Blocks the causal mask or a sliding window
leaves empty are skipped (:func:`attention.masks.block_rounds`)."""

from __future__ import annotations

import math
from typing import Any

import torch

from attention._dist import Group, sendrecv, wait_all
from attention.backends import Backend, acc_dtype
from attention.layout import CPLayout
from attention.masks import Mask, backward_rounds, block_rounds, forward_rounds
from attention.merge import Accumulator


def _split_kv(buf: torch.Tensor, n_tok: int, hk: int, d: int):
    half = n_tok * hk * d
    return buf[:half].view(n_tok, hk, d), buf[half:].view(n_tok, hk, d)


def _kv_ring(kv: torch.Tensor, counts, per_token: int, g: Group, device: torch.device):
    """Yield (i, s, kv) for i = 0..c-1: rank s = r - i's travelling keys and values packed flat in `kv`, with the
    transfer of the next block already posted; it is waited for when the caller asks for the next block (after
    computing)."""
    c, r = g.size, g.rank
    kv_comm = kv.to(g.comm_device)  # gloo moves CPU tensors: CUDA KV is staged through the host
    for i in range(c):
        reqs, nxt = [], None
        if i + 1 < c:
            nxt = kv_comm.new_empty(int(counts[(r - i - 1) % c]) * per_token)
            reqs = sendrecv(g, kv_comm, nxt, tag=0)
        yield i, (r - i) % c, kv
        wait_all(reqs)
        if nxt is not None:
            kv_comm = nxt
            kv = nxt.to(device)


def _travelling_kv(k, v, layout: CPLayout, rank: int) -> torch.Tensor:
    """This rank's travelling K and V rows (split documents only) packed flat: [K rows | V rows]."""
    return torch.cat([layout.travelling(k, rank).reshape(-1), layout.travelling(v, rank).reshape(-1)])


def ring_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: CPLayout,
    g: Group,
    causal: bool | Mask,
    scale: float,
    be: Backend,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out in q.dtype, lse in the accumulation dtype) for this rank's queries. ``causal``: a bool or an
    :class:`attention.masks.Mask` (window, softcap). Step 0 is the local block (whole local K/V); steps 1..c-1 use
    the other ranks' travelling K/V."""
    r = g.rank
    counts = layout.kv_counts
    hk, d = k.shape[1], k.shape[2]
    acc = Accumulator()
    for i, s, kv in _kv_ring(_travelling_kv(k, v, layout, r), counts, 2 * hk * d, g, q.device):
        rounds = block_rounds(layout, r, s, causal)  # [] when the mask leaves nothing: no compute this step
        if rounds and i:
            rounds = layout.to_travelling(rounds, s)
        if rounds:
            kb, vb = (k, v) if i == 0 else _split_kv(kv, int(counts[s]), hk, d)
            forward_rounds(be, q, kb, vb, rounds, scale, acc)
    if acc.out is None or acc.lse is None:
        out = q.new_zeros(q.shape)
        lse = torch.full(q.shape[:2], -math.inf, dtype=acc_dtype(q.dtype), device=q.device)
        return out, lse
    return acc.out.to(q.dtype), acc.lse


def ring_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    layout: CPLayout,
    g: Group,
    causal: bool | Mask,
    scale: float,
    be: Backend,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact gradients (dq, dk, dv) in the accumulation dtype. The local block's dK/dV stay home; the dK/dV of a
    travelling block ride the ring in that dtype behind it (c-1 hops) and are added to the owner's rows at the end."""
    c, r = g.size, g.rank
    counts = layout.kv_counts
    hk, d = k.shape[1], k.shape[2]
    a = acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=a, device=q.device)
    dk = torch.zeros(k.shape, dtype=a, device=q.device)
    dv = torch.zeros(v.shape, dtype=a, device=q.device)
    dkv_reqs: list = []
    dkv_in = torch.empty(0, dtype=a, device=g.comm_device)  # replaced by each hop's receive buffer
    for i, s, kv in _kv_ring(_travelling_kv(k, v, layout, r), counts, 2 * hk * d, g, q.device):
        rounds = block_rounds(layout, r, s, causal)
        if rounds and i:
            rounds = layout.to_travelling(rounds, s)
        if i == 0:
            if rounds:
                gq, gk, gv = backward_rounds(be, dout, q, k, v, out, lse, rounds, scale)
                dq += gq
                dk += gk
                dv += gv
            continue
        if i == 1:
            dkv = torch.zeros(int(counts[s]) * 2 * hk * d, dtype=a, device=q.device)
        else:
            wait_all(dkv_reqs)  # dK/dV of block s accumulated by the previous ranks
            dkv = dkv_in.to(q.device)
        if rounds:
            kb, vb = _split_kv(kv, int(counts[s]), hk, d)
            gq, gk, gv = backward_rounds(be, dout, q, kb, vb, out, lse, rounds, scale)
            dq += gq
            dkv += torch.cat([gk.reshape(-1), gv.reshape(-1)])
        dkv_in = torch.empty(int(counts[(r - i - 1) % c]) * 2 * hk * d, dtype=a, device=g.comm_device)
        dkv_reqs = sendrecv(g, dkv.to(g.comm_device), dkv_in, tag=1)
    if c > 1:
        wait_all(dkv_reqs)  # the last hop brings this rank's own travelling block home
        home_k, home_v = _split_kv(dkv_in.to(q.device), int(counts[r]), hk, d)
        layout.add_travelling_(dk, r, home_k)
        layout.add_travelling_(dv, r, home_v)
    return dq, dk, dv


class RingAttention(torch.autograd.Function):
    """autograd wrapper: forward :func:`ring_forward`, backward :func:`ring_backward`."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: CPLayout,
        g: Group,
        causal: bool | Mask,
        scale: float,
        be: Backend,
    ) -> torch.Tensor:
        out, lse = ring_forward(q, k, v, layout, g, causal, scale, be)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (layout, g, causal, scale, be)
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(dout.contiguous(), q, k, v, out, lse, *ctx.args)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None
