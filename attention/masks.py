"""Attention masks beyond causal: flash-attn style sliding windows and tanh soft-capping, and the attention blocks
("rounds" of :class:`Pieces`) they leave between two CP ranks' local tokens.

``window_size=(left, right)``: query at document position ``p`` sees keys at positions ``p - left .. p + right``
(-1 = unbounded on that side; ``causal`` caps the right side at 0), as in flash-attn. ``softcap > 0`` replaces
each scaled score ``s`` with ``softcap * tanh(s / softcap)`` before the softmax (Gemma 2).

With a window, blocks are built per contiguous *run* of document positions (zigzag holds two runs of a document
per rank), each with its exact band; blocks the window leaves empty are dropped, so a ring step whose blocks all fall
outside the window computes nothing. A query run meets several key runs of its document, so the blocks come as
rounds whose query ranges are disjoint within each round, merged like the ring's steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from attention.backends import UNBOUNDED, Backend, Pieces

if TYPE_CHECKING:
    import torch

    from attention.layout import CPLayout
    from attention.merge import Accumulator


@dataclass(frozen=True)
class Mask:
    """``causal``, ``window`` (left, right), ``softcap``; see the module docstring."""

    causal: bool = True
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0

    @property
    def windowed(self) -> bool:
        left, right = self.window
        return left >= 0 or (right >= 0 and not self.causal)

    @property
    def key(self) -> tuple:
        return (bool(self.causal), int(self.window[0]), int(self.window[1]), float(self.softcap))

    def doc_bounds(self) -> tuple[int, int]:
        """(lo, hi) on ``query position - key position`` inside a document."""
        left, right = self.window
        lo = 0 if self.causal else (-right if right >= 0 else -UNBOUNDED)
        hi = left if left >= 0 else UNBOUNDED
        return lo, hi


def make_mask(causal: bool = True, window_size: Sequence[int] = (-1, -1), softcap: float = 0.0) -> Mask:
    """Validated :class:`Mask`; ValueError naming the argument otherwise."""
    try:
        left, right = (int(w) for w in window_size)
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair (left, right) of ints, got {window_size!r}") from None
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= 0, or -1 for unbounded; got {window_size!r}")
    softcap = float(softcap)
    if not softcap >= 0.0 or softcap == float("inf"):
        raise ValueError(f"softcap must be a finite number >= 0 (0 = off), got {softcap!r}")
    return Mask(bool(causal), (left, 0 if causal and right >= 0 else right), softcap)


def as_mask(mask: bool | Mask) -> Mask:
    """A bool (plain causal or full) or a :class:`Mask`."""
    return mask if isinstance(mask, Mask) else Mask(bool(mask))


def _runs(layout, rank: int):
    """Contiguous runs of document positions among ``rank``'s local tokens: (doc, local start, length, position)."""
    doc = layout.local_doc_ids(rank)
    pos = layout.position_ids(rank)
    if doc.shape[0] == 0:
        z = np.zeros(0, dtype=np.int64)
        return z, z, z, z
    brk = np.ones(doc.shape[0], dtype=bool)
    brk[1:] = (doc[1:] != doc[:-1]) | (pos[1:] != pos[:-1] + 1)
    start = np.nonzero(brk)[0]
    length = np.diff(np.append(start, doc.shape[0]))
    return doc[start], start, length, pos[start]


def _windowed_rounds(layout, q_rank: int, kv_rank: int, mask: Mask) -> list[Pieces]:
    qd, qs, ql, qp = _runs(layout, q_rank)
    kd, ks, kl, kp = _runs(layout, kv_rank)
    order = np.argsort(kd, kind="stable")
    kd, ks, kl, kp = kd[order], ks[order], kl[order], kp[order]
    first = np.searchsorted(kd, qd, side="left")
    count = np.searchsorted(kd, qd, side="right") - first
    qi = np.repeat(np.arange(qd.shape[0]), count)  # one row per (query run, key run) of the same document
    ordinal = np.arange(qi.shape[0]) - np.repeat(np.cumsum(count) - count, count)
    ki = first[qi] + ordinal
    lo, hi = mask.doc_bounds()
    delta = qp[qi] - kp[ki]
    rounds = []
    for o in range(int(count.max()) if count.shape[0] else 0):
        sel = ordinal == o
        p = Pieces(qs[qi[sel]], ql[qi[sel]], ks[ki[sel]], kl[ki[sel]], False, lo - delta[sel],
                   np.minimum(hi - delta[sel], UNBOUNDED), mask.softcap)  # fmt: skip
        if len(p):
            rounds.append(p)
    return rounds


def block_rounds(layout: CPLayout, q_rank: int, kv_rank: int, mask: bool | Mask) -> list[Pieces]:
    """Rounds of attention blocks between ``q_rank``'s local queries and ``kv_rank``'s local keys under ``mask``
    (a :class:`Mask` or a bool for plain causal/full); empty when the mask leaves nothing. Cached on the layout."""
    mask = as_mask(mask)
    key = ("rounds", q_rank, kv_rank, mask.key)
    cache = layout._cache
    if key not in cache:
        if mask.windowed:
            cache[key] = _windowed_rounds(layout, q_rank, kv_rank, mask)
        else:
            p = layout.pieces(q_rank, kv_rank, mask.causal)
            if mask.softcap:
                p = Pieces(p.q_start, p.q_len, p.k_start, p.k_len, False, p.lo, p.hi, mask.softcap)
            cache[key] = [p] if len(p) else []
    return cache[key]


def forward_rounds(
    be: Backend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rounds: list[Pieces], scale: float, acc: Accumulator
) -> None:
    """Fold every round's partial result into the accumulator ``acc``."""
    for p in rounds:
        acc.add(*be.forward(q, k, v, p, scale))


def backward_rounds(
    be: Backend,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    rounds: list[Pieces],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Summed (dq, dk, dv) of every round (accumulation dtype); `rounds` holds at least one round."""
    if not rounds:
        raise ValueError("backward_rounds needs at least one round")
    dq, dk, dv = be.backward(dout, q, k, v, out, lse, rounds[0], scale)
    for p in rounds[1:]:
        g = be.backward(dout, q, k, v, out, lse, p, scale)
        dq, dk, dv = dq + g[0], dk + g[1], dv + g[2]
    return dq, dk, dv
