"""All-gather attention (llama3 style): every rank gathers the group's travelling KV (the split documents' rows: all
of them in zigzag/contiguous, none of the whole documents in hybrid), computes its local queries against its own
local KV and the others' gathered blocks (the same empty-block skipping and float32 merge as the ring), and in the
backward reduce-scatters the travelling rows' dK/dV (float32) back to the owners. Nothing is exchanged when no
document is split. ``head_chunks > 1`` gathers KV by groups of KV heads, the next group's gather
overlapped with the current group's compute, so only one group's gathered KV is alive at a time."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from attention._dist import Group, count_sent, reduce_scatter_sum
from attention.backends import Backend, acc_dtype
from attention.layout import CPLayout
from attention.masks import Mask, backward_rounds, block_rounds, forward_rounds
from attention.merge import Accumulator


def _head_groups(hk: int, chunks: int) -> list[tuple[int, int]]:
    edges = np.linspace(0, hk, min(max(1, chunks), hk) + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:]) if b > a]


class _Gather:
    """Asynchronous all-gather of k/v heads [a, b) from every rank, padded to the largest local token count."""

    def __init__(self, k, v, a: int, b: int, counts: np.ndarray, g: Group) -> None:
        self.counts, self.shape = counts, (b - a, k.shape[2])
        tmax = int(counts.max())
        self.work = None
        if tmax == 0:  # no split document: nothing to gather
            self.parts = [k.new_zeros(2, 0, b - a, k.shape[2]) for _ in range(g.size)]
            return
        buf = k.new_zeros(2, tmax, b - a, k.shape[2], device=g.comm_device)
        buf[0, : k.shape[0]] = k[:, a:b]
        buf[1, : k.shape[0]] = v[:, a:b]
        self.parts = [torch.empty_like(buf) for _ in range(g.size)]
        count_sent(buf, g.size - 1)
        self.work = dist.all_gather(self.parts, buf, group=g.group, async_op=True)

    def wait(self, device):
        if self.work is not None:
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


def _rounds(layout: CPLayout, rank: int, s: int, causal) -> list:
    """Blocks of this rank's queries against rank s's keys: local ones, or s's travelling (gathered) ones."""
    rounds = block_rounds(layout, rank, s, causal)
    return rounds if s == rank else layout.to_travelling(rounds, s)


def allgather_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: CPLayout,
    g: Group,
    causal: bool | Mask,
    scale: float,
    be: Backend,
    head_chunks: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    counts = layout.kv_counts
    hk = k.shape[1]
    grp = q.shape[1] // hk
    out = q.new_zeros(q.shape)
    lse = torch.full(q.shape[:2], -float("inf"), dtype=acc_dtype(q.dtype), device=q.device)
    kt, vt = layout.travelling(k, g.rank), layout.travelling(v, g.rank)
    for a, b, kvs in _gathered(kt, vt, _head_groups(hk, head_chunks), counts, g, q.device):
        kvs[g.rank] = (k[:, a:b], v[:, a:b])  # the local block sees all local keys
        qh = q[:, a * grp : b * grp]
        acc = Accumulator()
        for s in range(g.size):
            forward_rounds(be, qh, kvs[s][0], kvs[s][1], _rounds(layout, g.rank, s, causal), scale, acc)
        if acc.out is not None and acc.lse is not None:
            out[:, a * grp : b * grp] = acc.out.to(q.dtype)
            lse[:, a * grp : b * grp] = acc.lse
    return out, lse


def allgather_backward(
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
    head_chunks: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    counts = layout.kv_counts
    hk, d = k.shape[1], k.shape[2]
    grp = q.shape[1] // hk
    a_dt = acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=a_dt, device=q.device)
    dk = torch.zeros(k.shape, dtype=a_dt, device=q.device)
    dv = torch.zeros(v.shape, dtype=a_dt, device=q.device)
    tmax = int(counts.max())
    dkv = torch.zeros(g.size, 2, tmax, hk, d, dtype=a_dt, device=q.device)  # travelling blocks' gradients
    kt, vt = layout.travelling(k, g.rank), layout.travelling(v, g.rank)
    for a, b, kvs in _gathered(kt, vt, _head_groups(hk, head_chunks), counts, g, q.device):
        kvs[g.rank] = (k[:, a:b], v[:, a:b])
        qs = slice(a * grp, b * grp)
        for s in range(g.size):
            rounds = _rounds(layout, g.rank, s, causal)
            if rounds:
                gq, gk, gv = backward_rounds(
                    be, dout[:, qs], q[:, qs], kvs[s][0], kvs[s][1], out[:, qs], lse[:, qs], rounds, scale
                )
                dq[:, qs] += gq
                dst_k, dst_v = (dk, dv) if s == g.rank else (dkv[s, 0, : int(counts[s])], dkv[s, 1, : int(counts[s])])
                dst_k[:, a:b] += gk
                dst_v[:, a:b] += gv
    if tmax:
        mine = reduce_scatter_sum(g, [dkv[s].to(g.comm_device) for s in range(g.size)]).to(q.device)
        n = int(counts[g.rank])
        layout.add_travelling_(dk, g.rank, mine[0, :n])
        layout.add_travelling_(dv, g.rank, mine[1, :n])
    return dq, dk, dv


class AllGatherAttention(torch.autograd.Function):
    """autograd wrapper: forward :func:`allgather_forward`, backward :func:`allgather_backward`."""

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
        head_chunks: int,
    ) -> torch.Tensor:
        out, lse = allgather_forward(q, k, v, layout, g, causal, scale, be, head_chunks)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (layout, g, causal, scale, be, head_chunks)
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = allgather_backward(dout.contiguous(), q, k, v, out, lse, *ctx.args)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None
