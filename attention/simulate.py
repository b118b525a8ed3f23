"""Single-process simulation of a CP schedule: every CP rank's shard lives in this process, and every kernel call
the ranks would make (the same attention blocks, in the same order, with the same merges) runs here, without
communication. It checks a method's kernel sequence on one device (exact against single-device attention) and
lets a benchmark time the pieces of a schedule against one single-device call over the same tokens.

``simulate(...)`` returns the output (and, given ``dout``, the gradients) in global packed order. Wrap the backend
in :class:`TimedBackend` to record every kernel call's duration.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Optional

import numpy as np
import torch
from numpy.typing import ArrayLike

from attention.backends import Backend, Pieces, acc_dtype, check_inputs, get_backend
from attention.layout import CPLayout
from attention.masks import Mask, block_rounds, make_mask
from attention.merge import Accumulator
from attention.ulysses import kv_replication
from attention.varlen import attend, attend_backward, varlen_rounds


class TimedBackend(Backend):
    """Wraps a backend; ``record(kind, seconds, pieces)`` is called after every forward/backward kernel call.
    ``clock()`` returns a token and ``elapsed(token)`` seconds (host timer by default; CUDA events on a GPU)."""

    def __init__(self, inner: Backend, record: Callable, clock=None, elapsed=None) -> None:
        self.inner, self.record = inner, record
        self.name = inner.name
        self.clock = clock or time.perf_counter
        self.elapsed = elapsed or (lambda t0: time.perf_counter() - t0)

    def supports(self, q: torch.Tensor, k: torch.Tensor, window: bool = False, softcap: bool = False) -> bool:
        return self.inner.supports(q, k, window, softcap)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pieces: Pieces, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        t0 = self.clock()
        res = self.inner.forward(q, k, v, pieces, scale)
        self.record("fwd", self.elapsed(t0), pieces)
        return res

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        pieces: Pieces,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t0 = self.clock()
        res = self.inner.backward(dout, q, k, v, out, lse, pieces, scale)
        self.record("bwd", self.elapsed(t0), pieces)
        return res


def _kv_order(method: str, rank: int, cp: int) -> list[int]:
    """The order in which ``rank`` meets the ranks' K/V: the ring's rotation, or gathered order."""
    return [(rank - i) % cp for i in range(cp)] if method == "ring" else list(range(cp))


def _ring_like(q, k, v, layout: CPLayout, method, mask: Mask, scale, be, dout):
    cp = layout.cp_size
    qs, ks, vs = ([layout.shard(x, r) for r in range(cp)] for x in (q, k, v))
    outs, lses = [], []
    for r in range(cp):
        acc = Accumulator()
        for s in _kv_order(method, r, cp):
            for p in block_rounds(layout, r, s, mask):
                acc.add(*be.forward(qs[r], ks[s], vs[s], p, scale))
        if acc.out is None or acc.lse is None:
            outs.append(qs[r].new_zeros(qs[r].shape))
            lses.append(torch.full(qs[r].shape[:2], -math.inf, dtype=acc_dtype(q.dtype), device=q.device))
        else:
            outs.append(acc.out.to(q.dtype))
            lses.append(acc.lse)
    out = layout.unshard(outs)
    if dout is None:
        return out, None
    a = acc_dtype(q.dtype)
    dq = [torch.zeros(x.shape, dtype=a, device=x.device) for x in qs]
    dk = [torch.zeros(x.shape, dtype=a, device=x.device) for x in ks]
    dv = [torch.zeros(x.shape, dtype=a, device=x.device) for x in vs]
    douts = [layout.shard(dout, r) for r in range(cp)]
    for r in range(cp):
        for s in _kv_order(method, r, cp):
            for p in block_rounds(layout, r, s, mask):
                gq, gk, gv = be.backward(douts[r], qs[r], ks[s], vs[s], outs[r], lses[r], p, scale)
                dq[r] += gq
                dk[s] += gk
                dv[s] += gv
    return out, tuple(layout.unshard(g) for g in (dq, dk, dv))


def _ulysses(q, k, v, layout: CPLayout, mask: Mask, scale, be, dout):
    cp, h = layout.cp_size, q.shape[1]
    if h % cp:
        raise ValueError(f"ulysses: {h} query heads are not divisible by cp_size {cp}")
    rep = kv_replication(h, k.shape[1], cp)
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    hs, hks = h // cp, k.shape[1] // cp
    rounds = varlen_rounds(layout.cu_seqlens, mask, None)
    out = torch.empty_like(q)
    a = acc_dtype(q.dtype)
    grads = tuple(torch.zeros(x.shape, dtype=a, device=x.device) for x in (q, k, v)) if dout is not None else None
    for j in range(cp):  # rank j's head slice over every token
        qh, kh, vh = q[:, j * hs : (j + 1) * hs], k[:, j * hks : (j + 1) * hks], v[:, j * hks : (j + 1) * hks]
        o, lse = attend(qh, kh, vh, rounds, scale, be)
        out[:, j * hs : (j + 1) * hs] = o
        if grads is not None:
            g = attend_backward(dout[:, j * hs : (j + 1) * hs], qh, kh, vh, o, lse, rounds, scale, be)
            grads[0][:, j * hs : (j + 1) * hs] = g[0]
            grads[1][:, j * hks : (j + 1) * hks] = g[1]
            grads[2][:, j * hks : (j + 1) * hks] = g[2]
    if grads is not None and rep > 1:  # replicas' gradients sum back to their K/V head
        grads = (grads[0], *(x.reshape(x.shape[0], -1, rep, x.shape[2]).sum(2) for x in grads[1:]))
    return out, grads


def simulate(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: ArrayLike | torch.Tensor,
    cp_size: int,
    method: str = "ring",
    kind: str = "zigzag",
    causal: bool = True,
    softmax_scale: Optional[float] = None,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    backend: str | Backend = "auto",
    dout: Optional[torch.Tensor] = None,
) -> dict:
    """Run ``method``'s kernel sequence for all ``cp_size`` ranks in this process. q ``[T, H, D]``, k/v
    ``[T, Hkv, D]`` in global packed order; returns ``(out [T, H, D], (dq, dk, dv) or None)`` in global order,
    gradients in the accumulation dtype (given ``dout``)."""
    check_inputs(q, k, v)
    layout = CPLayout.build(cu_seqlens, cp_size, kind=kind)
    mask = make_mask(causal, window_size, softcap)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[2])
    lens = np.diff(layout.cu_seqlens)
    be = get_backend(backend, q, k, mask.windowed, mask.softcap > 0, int(lens.max()) if lens.size else 0)
    if method == "ulysses":
        return _ulysses(q, k, v, layout, mask, scale, be, dout)
    if method not in ("ring", "allgather"):
        raise ValueError(f"method must be ring, allgather or ulysses, got {method!r}")
    return _ring_like(q, k, v, layout, method, mask, scale, be, dout)
