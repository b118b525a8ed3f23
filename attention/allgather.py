"""All-gather attention (llama3 style): every rank gathers the whole group's KV, computes its local queries against
it block by block (the same empty-block skipping and float32 merge as the ring), and in the backward reduce-scatters
dK/dV (float32) back to the owners. ``head_chunks > 1`` gathers KV by groups of KV heads, the next group's gather
overlapped with the current group's compute, so only one group's gathered KV is alive at a time."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from ._dist import Group, reduce_scatter_sum
from .backends import Backend, acc_dtype
from .layout import CPLayout
from .masks import backward_rounds, block_rounds, forward_rounds
from .merge import Accumulator


def _head_groups(hk: int, chunks: int) -> list[tuple[int, int]]:
    edges = np.linspace(0, hk, min(max(1, chunks), hk) + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:]) if b > a]


class _Gather:
    """Asynchronous all-gather of k/v heads [a, b) from every rank, padded to the largest local token count."""

    def __init__(self, k, v, a: int, b: int, counts: np.ndarray, g: Group) -> None:
        self.counts, self.shape = counts, (b - a, k.shape[2])
        tmax = int(counts.max())
        buf = k.new_zeros(2, tmax, b - a, k.shape[2], device=g.comm_device)
        buf[0, : k.shape[0]] = k[:, a:b]
        buf[1, : k.shape[0]] = v[:, a:b]
        self.parts = [torch.empty_like(buf) for _ in range(g.size)]
        self.work = dist.all_gather(self.parts, buf, group=g.group, async_op=True)

    def wait(self, device):
        self.work.wait()
        return [(p[0, : int(n)].to(device), p[1, : int(n)].to(device)) for p, n in zip(self.parts, self.counts)]


def _gathered(k, v, heads: list[tuple[int, int]], counts: np.ndarray, g: Group, device):
    """Yield (first head, end head, [(K, V) of every rank]) per KV head group, the next group's gather posted
    before the current one is handed out."""
    pending = _Gather(k, v, *heads[0], counts, g)
    for j, (a, b) in enumerate(heads):
        kvs = pending.wait(device)
        if j + 1 < len(heads):
            pending = _Gather(k, v, *heads[j + 1], counts, g)
        yield a, b, kvs


def allgather_forward(q, k, v, layout: CPLayout, g: Group, causal, scale: float, be: Backend, head_chunks: int = 1):
    counts = layout.local_counts
    hk = k.shape[1]
    grp = q.shape[1] // hk
    out = q.new_zeros(q.shape)
    lse = torch.full(q.shape[:2], -float("inf"), dtype=acc_dtype(q.dtype), device=q.device)
    for a, b, kvs in _gathered(k, v, _head_groups(hk, head_chunks), counts, g, q.device):
        qh = q[:, a * grp : b * grp]
        acc = Accumulator()
        for s in range(g.size):
            forward_rounds(be, qh, kvs[s][0], kvs[s][1], block_rounds(layout, g.rank, s, causal), scale, acc)
        if acc.out is not None:
            out[:, a * grp : b * grp] = acc.out.to(q.dtype)
            lse[:, a * grp : b * grp] = acc.lse
    return out, lse


def allgather_backward(
    dout, q, k, v, out, lse, layout: CPLayout, g: Group, causal, scale: float, be: Backend, head_chunks: int = 1
):
    counts = layout.local_counts
    hk, d = k.shape[1], k.shape[2]
    grp = q.shape[1] // hk
    a_dt = acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=a_dt, device=q.device)
    tmax = int(counts.max())
    dkv = torch.zeros(g.size, 2, tmax, hk, d, dtype=a_dt, device=q.device)
    for a, b, kvs in _gathered(k, v, _head_groups(hk, head_chunks), counts, g, q.device):
        qs = slice(a * grp, b * grp)
        for s in range(g.size):
            rounds = block_rounds(layout, g.rank, s, causal)
            if rounds:
                gq, gk, gv = backward_rounds(
                    be, dout[:, qs], q[:, qs], kvs[s][0], kvs[s][1], out[:, qs], lse[:, qs], rounds, scale
                )
                dq[:, qs] += gq
                n = int(counts[s])
                dkv[s, 0, :n, a:b] = gk
                dkv[s, 1, :n, a:b] = gv
    mine = reduce_scatter_sum(g, [dkv[s].to(g.comm_device) for s in range(g.size)]).to(q.device)
    n = int(counts[g.rank])
    return dq, mine[0, :n], mine[1, :n]


class AllGatherAttention(torch.autograd.Function):
    """autograd wrapper: forward :func:`allgather_forward`, backward :func:`allgather_backward`."""

    @staticmethod
    def forward(ctx, q, k, v, layout, g, causal, scale, be, head_chunks):
        out, lse = allgather_forward(q, k, v, layout, g, causal, scale, be, head_chunks)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (layout, g, causal, scale, be, head_chunks)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = allgather_backward(dout.contiguous(), q, k, v, out, lse, *ctx.args)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None
