"""Single-device attention over packed variable-length documents (THD layout), with autograd and optional
key/value chunking merged in float32 through :mod:`attention.merge`."""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Optional

import numpy as np
import torch
from numpy.typing import ArrayLike

from attention.backends import Backend, Pieces, check_inputs, get_backend
from attention.masks import Mask, as_mask, make_mask
from attention.merge import Accumulator


def _cu_numpy(cu_seqlens, total: int) -> np.ndarray:
    cu = cu_seqlens.detach().cpu().numpy() if isinstance(cu_seqlens, torch.Tensor) else np.asarray(cu_seqlens)
    if cu.ndim != 1 or cu.shape[0] < 1 or not np.issubdtype(cu.dtype, np.integer):
        raise ValueError(f"cu_seqlens must be a 1-D integer array [n_docs+1], got shape {cu.shape}")
    cu = cu.astype(np.int64)
    if cu[0] != 0 or (np.diff(cu) < 0).any() or cu[-1] != total:
        raise ValueError(
            f"cu_seqlens must start at 0, be non-decreasing and end at the token count {total}, "
            f"got [{cu[0]}, ..., {cu[-1]}]"
        )
    return cu


def varlen_rounds(cu: np.ndarray, mask: bool | Mask, chunk_size: Optional[int]) -> list[Pieces]:
    """Pieces of packed attention under ``mask`` (a :class:`Mask`, or a bool for plain causal/full), as rounds whose
    query ranges are disjoint. Without ``chunk_size``: one round, one piece per document. With it: documents are
    tiled into chunks of ``chunk_size`` tokens; round ``o`` holds the (query chunk ``i``, key chunk ``i - o``) pairs,
    so every kernel call sees at most chunk_size x chunk_size; chunk pairs outside a window are dropped."""
    mask = as_mask(mask)
    causal = mask.causal
    lo, hi = mask.doc_bounds()
    starts, lens = cu[:-1], np.diff(cu)
    if chunk_size is None:
        p = Pieces(starts, lens, starts, lens, False, lo, hi, mask.softcap)
        return [p] if len(p) else []
    n_ch = -(-lens // chunk_size)  # chunks per document
    doc = np.repeat(np.arange(lens.shape[0]), n_ch)
    idx = np.arange(doc.shape[0]) - np.repeat(np.cumsum(n_ch) - n_ch, n_ch)
    c_start = starts[doc] + idx * chunk_size
    c_len = np.minimum(chunk_size, lens[doc] - idx * chunk_size)
    last = n_ch[doc] - 1 - idx  # chunks after this one in its document
    rounds = []
    max_ch = int(n_ch.max()) if n_ch.shape[0] else 0
    offsets = range(max_ch) if causal else range(-(max_ch - 1), max_ch)
    for o in offsets:
        qsel = np.nonzero(idx >= o)[0] if o >= 0 else np.nonzero(last >= -o)[0]
        ksel = qsel - o
        delta = o * chunk_size  # query chunk position - key chunk position
        rounds.append(Pieces(c_start[qsel], c_len[qsel], c_start[ksel], c_len[ksel], False, lo - delta, hi - delta,
                             mask.softcap))  # fmt: skip
    return [r for r in rounds if len(r)]


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rounds: list[Pieces], scale: float, be: Backend
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward over rounds of pieces, merged: returns (out in q.dtype, lse in the accumulation dtype)."""
    if len(rounds) == 1:
        out, lse = be.forward(q, k, v, rounds[0], scale)
        return out.to(q.dtype), lse
    acc = Accumulator()
    for p in rounds:
        acc.add(*be.forward(q, k, v, p, scale))
    if acc.out is None or acc.lse is None:
        out, lse = be.forward(q, k, v, Pieces.empty(), scale)
        return out.to(q.dtype), lse
    return acc.out.to(q.dtype), acc.lse


def attend_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    rounds: list[Pieces],
    scale: float,
    be: Backend,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (accumulation dtype) of :func:`attend`, from the merged out/lse."""
    if not rounds:
        return be._zero_grads(q, k, v)
    dq, dk, dv = be.backward(dout, q, k, v, out, lse, rounds[0], scale)
    for p in rounds[1:]:
        g = be.backward(dout, q, k, v, out, lse, p, scale)
        dq += g[0]
        dk += g[1]
        dv += g[2]
    return dq, dk, dv


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, rounds, scale, be):
        out, lse = attend(q, k, v, rounds, scale, be)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.rounds, ctx.scale, ctx.be = rounds, scale, be
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = attend_backward(dout.contiguous(), q, k, v, out, lse, ctx.rounds, ctx.scale, ctx.be)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: ArrayLike | torch.Tensor,
    causal: bool = True,
    softmax_scale: Optional[float] = None,
    backend: str | Backend = "auto",
    chunk_size: Optional[int] = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
) -> torch.Tensor:
    """Attention over packed documents on one device, like ``flash_attn_varlen_func`` for self-attention.

    q ``[T, H, D]``, k/v ``[T, Hkv, D]`` (``H % Hkv == 0``), ``cu_seqlens`` ints ``[n_docs+1]`` ending at ``T``.
    Tokens attend only within their document (and, if ``causal``, to earlier positions). ``softmax_scale``
    defaults to ``D**-0.5``. ``chunk_size`` bounds every kernel call to ``chunk_size`` queries x keys and merges the
    key chunks with the float32 log-sum-exp. ``window_size=(left, right)``: flash-attn sliding window (-1 =
    unbounded); ``softcap``: tanh soft-capping of the scaled scores (0 = off). Differentiable in q, k, v. Returns
    ``[T, H, D]`` in q's dtype.
    """
    check_inputs(q, k, v)
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"varlen_attention is self-attention: q has {q.shape[0]} tokens, k/v {k.shape[0]}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    cu = _cu_numpy(cu_seqlens, q.shape[0])
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[2])
    mask = make_mask(causal, window_size, softcap)
    longest = int(np.diff(cu).max()) if cu.shape[0] > 1 else 0
    be = get_backend(backend, q, k, mask.windowed, mask.softcap > 0, min(longest, chunk_size or longest))
    return _VarlenAttention.apply(q, k, v, cached_rounds(cu, mask, chunk_size), scale, be)


_ROUNDS: OrderedDict = OrderedDict()


def cached_rounds(cu: np.ndarray, mask: bool | Mask, chunk_size: Optional[int], capacity: int = 64) -> list[Pieces]:
    """:func:`varlen_rounds`, remembered for the last ``capacity`` batches: every layer of a model sees the same
    batch, so its pieces (and their device-side index tensors) are built once, not per layer."""
    key = (cu.tobytes(), as_mask(mask).key, chunk_size)
    if key in _ROUNDS:
        _ROUNDS.move_to_end(key)
    else:
        _ROUNDS[key] = varlen_rounds(cu, mask, chunk_size)
        if len(_ROUNDS) > capacity:
            _ROUNDS.popitem(last=False)
    return _ROUNDS[key]
