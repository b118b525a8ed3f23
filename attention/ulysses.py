"""Ulysses (DeepSpeed-Ulysses style) context-parallel attention: an all-to-all trades the sequence split for a head
split, every rank runs ordinary single-device varlen attention over the whole packed batch for ``H / W`` of the
heads, and a second all-to-all trades back. Exact (it is plain attention on every head), forward and backward (the
backward of an all-to-all is the reverse all-to-all), any mask :func:`attention.varlen_attention` takes, and any
layout kind (tokens are put back in global order with ``layout.local_indices``).

Query heads must be divisible by the CP size ``W``. K/V heads that are not (GQA with fewer K/V heads than ranks,
or a count not divisible by ``W``) are replicated by the smallest factor that makes them divisible while keeping
every query head's K/V head on its rank; gradients of the replicas sum back (autograd of ``repeat_interleave``).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from attention._dist import Group, count_rows_sent
from attention.backends.base import Backend
from attention.layout import CPLayout
from attention.masks import Mask
from attention.varlen import varlen_attention


def kv_replication(heads: int, kv_heads: int, world: int) -> int:
    """Smallest ``r`` dividing ``heads / kv_heads`` with ``kv_heads * r`` divisible by ``world``."""
    group = heads // kv_heads
    for r in range(1, group + 1):
        if group % r == 0 and (kv_heads * r) % world == 0:
            return r
    raise ValueError(f"ulysses: {heads} query heads cannot be split over {world} ranks")  # heads % world != 0


def _a2a(g: Group, send: torch.Tensor, send_rows: list[int], recv_rows: list[int]) -> torch.Tensor:
    """all_to_all_single over dim 0 with per-rank row counts, on the group's comm device."""
    out = send.new_empty((sum(recv_rows),) + tuple(send.shape[1:]), device=g.comm_device)
    count_rows_sent(send, sum(send_rows) - send_rows[g.rank])  # the rows addressed to the other ranks
    dist.all_to_all_single(out, send.contiguous().to(g.comm_device), recv_rows, send_rows, group=g.group)
    return out.to(send.device)


def seq_to_heads(x: torch.Tensor, g: Group, counts: list[int]) -> torch.Tensor:
    """``[T_local, H, D]`` on every rank -> ``[T_total, H / W, D]``: rank j gets head slice j of every rank's
    tokens, rank-major (rank 0's tokens, then rank 1's, ...)."""
    w = g.size
    hs = x.shape[1] // w
    send = torch.cat([x[:, j * hs : (j + 1) * hs] for j in range(w)])  # [W * T_local, hs, D], by destination
    return _a2a(g, send, [x.shape[0]] * w, counts)


def heads_to_seq(y: torch.Tensor, g: Group, counts: list[int]) -> torch.Tensor:
    """Inverse of :func:`seq_to_heads`: ``[T_total, H / W, D]`` -> ``[T_local, H, D]``."""
    w, mine = g.size, counts[g.rank]
    recv = _a2a(g, y, counts, [mine] * w)  # [W * T_local, hs, D], by source head slice
    return torch.cat(list(recv.split(mine, dim=0)), dim=1) if mine else y.new_zeros(0, y.shape[1] * w, y.shape[2])


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g, counts):
        ctx.args = (g, counts)
        return seq_to_heads(x, g, counts)

    @staticmethod
    def backward(ctx, dy):
        return heads_to_seq(dy.contiguous(), *ctx.args), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, g, counts):
        ctx.args = (g, counts)
        return heads_to_seq(y, g, counts)

    @staticmethod
    def backward(ctx, dx):
        return seq_to_heads(dx.contiguous(), *ctx.args), None, None


def _global_order(layout: CPLayout, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(rank-major row -> global token, global token -> rank-major row) index tensors, cached per device."""
    key = ("ulysses_order", str(device))
    if key not in layout._cache:
        rank_major = np.concatenate([layout.local_indices(r) for r in range(layout.cp_size)])
        inverse = np.empty_like(rank_major)
        inverse[rank_major] = np.arange(rank_major.shape[0])
        layout._cache[key] = (torch.from_numpy(rank_major).to(device), torch.from_numpy(inverse).to(device))
    return layout._cache[key]


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: CPLayout,
    g: Group,
    mask: Mask,
    scale: float,
    backend: Backend,
) -> torch.Tensor:
    """This rank's ``[T_local, H, D]`` attention output; differentiable in q, k, v (see the module docstring)."""
    w = g.size
    counts = [int(c) for c in layout.local_counts]
    r = kv_replication(q.shape[1], k.shape[1], w)
    if r > 1:
        k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
    to_rank_major, to_global = _global_order(layout, q.device)
    qh, kh, vh = (_SeqToHeads.apply(x, g, counts).index_select(0, to_global) for x in (q, k, v))
    out = varlen_attention(
        qh, kh, vh, layout.cu_seqlens, mask.causal, scale, backend, window_size=mask.window, softcap=mask.softcap
    )
    return _HeadsToSeq.apply(out.index_select(0, to_rank_major), g, counts)
