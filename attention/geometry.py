"""CP chunk geometry: how a document's tokens and attention pairs split over the ranks of a CP group, per layout.

The one owner of the chunk rules and of the pair counts. Pure NumPy (no torch), so the planner's cost model
(`balancer.planning`), the hybrid placement (:mod:`attention.placement`) and the token layout
(:class:`attention.CPLayout`) all derive the same numbers from the same code.

Chunks per layout kind (see :mod:`attention.layout` for the full rules):
- zigzag and hybrid: ``2*cp`` chunks per split document, chunk ``j`` on rank ``min(j, 2cp-1-j)``; the remainder
  tokens go to the first ``rem`` chunks when ``rem <= cp``, else to the last ``rem``;
- contiguous: ``cp`` chunks, chunk ``r`` on rank ``r``, the first ``d % cp`` one token longer;
- a whole document of the hybrid layout sits entirely in chunk ``r`` (rank ``r``'s front chunk) of its rank.

Pair counts: causal attention computes ``d*(d+1)/2`` (query, key) pairs for a document, bidirectional ``d*d``;
with a sliding window of ``w`` keys per query (query ``i`` sees keys ``i-w+1 .. i``, the flash-attn / Hugging Face
convention) ``w*(w+1)/2 + (d-w)*w`` for ``d > w``. :func:`chunk_pairs` is the exact integer count of one chunk's
causal pairs; :func:`attention_pairs` and :func:`block_pairs` are the float64 forms the cost model sums.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike

KINDS = ("zigzag", "contiguous", "hybrid")


def zigzag_sizes(lens: np.ndarray, cp: int) -> np.ndarray:
    """int64 [n_docs, 2*cp]: zigzag chunk sizes (chunk j belongs to rank min(j, 2cp-1-j)); remainder tokens go to
    the first ``rem`` chunks when ``rem <= cp``, else to the last ``rem`` chunks."""
    lens = np.asarray(lens, dtype=np.int64)
    nch = 2 * cp
    base, rem = lens // nch, lens % nch
    j = np.arange(nch)[None, :]
    extra = np.where((rem <= cp)[:, None], j < rem[:, None], j >= (nch - rem)[:, None])
    return base[:, None] + extra.astype(np.int64)


def contiguous_sizes(lens: np.ndarray, cp: int) -> np.ndarray:
    """int64 [n_docs, cp]: contiguous chunk sizes (chunk r on rank r, the first ``d % cp`` one token longer)."""
    lens = np.asarray(lens, dtype=np.int64)
    return (lens // cp)[:, None] + (np.arange(cp)[None, :] < (lens % cp)[:, None]).astype(np.int64)


def chunk_owner(cp: int, kind: str) -> np.ndarray:
    """int64 [n_chunks]: the rank of every chunk of a document under layout ``kind``."""
    if kind == "contiguous":
        return np.arange(cp, dtype=np.int64)
    nch = 2 * cp
    return np.minimum(np.arange(nch), nch - 1 - np.arange(nch)).astype(np.int64)


def chunk_sizes(
    lens: np.ndarray, cp: int, kind: str, split: np.ndarray | None = None, doc_rank: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(sizes int64 [n_docs, n_chunks], owner int64 [n_chunks]) of documents ``lens`` on ``cp`` ranks.

    ``split`` (bool [n_docs], hybrid only; default all True) marks the documents cut into chunks; every other
    document lies whole in the front chunk of ``doc_rank[doc]``.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    lens = np.asarray(lens, dtype=np.int64)
    owner = chunk_owner(cp, kind)
    if kind == "contiguous":
        return contiguous_sizes(lens, cp), owner
    sizes = zigzag_sizes(lens, cp)
    if split is not None:
        whole = np.nonzero(~np.asarray(split, dtype=bool))[0]
        sizes[whole] = 0
        sizes[whole, np.asarray(doc_rank, dtype=np.int64)[whole]] = lens[whole]  # chunk r is rank r's front chunk
    return sizes, owner


def chunk_bounds(sizes: np.ndarray) -> np.ndarray:
    """int64 [n_docs, n_chunks+1]: chunk boundaries as offsets inside each document."""
    bounds = np.zeros((sizes.shape[0], sizes.shape[1] + 1), dtype=np.int64)
    np.cumsum(sizes, axis=1, out=bounds[:, 1:])
    return bounds


def causal_pairs(lens: ArrayLike) -> np.ndarray:
    """int64: exact causal (query, key) pairs ``d*(d+1)/2`` of documents of lengths ``lens``."""
    d = np.asarray(lens, dtype=np.int64)
    return d * (d + 1) // 2


def chunk_pairs(start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """int64: exact causal pairs whose query lies in positions ``[start, end)`` of its document (keys: every earlier
    position of the document and the query itself)."""
    return causal_pairs(end) - causal_pairs(start)


def rank_shares(sizes: np.ndarray, owner: np.ndarray, cp: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens int64 [cp], causal pairs int64 [cp]) each rank computes for documents cut into chunks ``sizes``."""
    bounds = chunk_bounds(sizes)
    per_chunk = chunk_pairs(bounds[:, :-1], bounds[:, 1:]).sum(axis=0)
    tokens = np.zeros(cp, dtype=np.int64)
    pairs = np.zeros(cp, dtype=np.int64)
    np.add.at(tokens, owner, sizes.sum(axis=0))
    np.add.at(pairs, owner, per_chunk)
    return tokens, pairs


def _clamped_prefix(x: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """`sum_{y <= x} clamp(y, 0, cap)` over integers y (0 for x <= 0), vectorised."""
    x = np.maximum(x, 0.0)
    inside = np.minimum(x, cap)
    return inside * (inside + 1.0) / 2.0 + np.maximum(x - cap, 0.0) * cap


def _causal_block_pairs(q_lo, q_hi, k_lo, k_hi, window) -> np.ndarray:
    """Pairs (i, j) with i in [q_lo, q_hi), j in [k_lo, k_hi) and 0 <= i - j < window (window inf: j <= i)."""

    def below(a, b):  # pairs with 0 <= i < a, 0 <= j < b, 0 <= i - j < window
        # sum_{i<a} (#{j <= i, j < b} - #{j <= i - window, j < b}) = sum_i clamp(i+1, 0, b) - clamp(i+1-window, 0, b)
        near = _clamped_prefix(a, b)
        if np.isinf(window).all():
            return near
        far = _clamped_prefix(a - window, b)
        return near - np.where(np.isinf(window), 0.0, far)

    return below(q_hi, k_hi) - below(q_lo, k_hi) - below(q_hi, k_lo) + below(q_lo, k_lo)


def block_pairs(
    q_lo: ArrayLike, q_hi: ArrayLike, k_lo: ArrayLike, k_hi: ArrayLike, causal: bool = True, window: int | None = None
) -> np.ndarray:
    """(query, key) pairs attention computes between query positions [q_lo, q_hi) and key positions [k_lo, k_hi)
    of one document (float64, vectorised over the arguments).

    Causal: pairs with `0 <= i - j < window`; non-causal: `|i - j| < window`; `window=None` is unlimited.
    """
    args = [np.asarray(a, dtype=np.float64) for a in (q_lo, q_hi, k_lo, k_hi)]
    q_lo, q_hi, k_lo, k_hi = np.broadcast_arrays(*args)
    w = np.full(q_lo.shape, np.inf if window is None else float(window))
    ahead = _causal_block_pairs(q_lo, q_hi, k_lo, k_hi, w)
    if causal:
        return ahead
    behind = _causal_block_pairs(k_lo, k_hi, q_lo, q_hi, w)  # j - i >= 0 within the window
    diagonal = np.maximum(np.minimum(q_hi, k_hi) - np.maximum(q_lo, k_lo), 0.0)
    return ahead + behind - diagonal


def attention_pairs(
    lengths: np.ndarray | Sequence[int] | int, causal: bool = True, window: int | None = None
) -> np.ndarray:
    """Number of (query, key) pairs attention computes for documents of the given lengths (float64).

    Full attention: `d*(d+1)/2` causal, `d*d` otherwise. With a sliding window of `w` keys per query:
    `d*(d+1)/2` for `d <= w`, else `w*(w+1)/2 + (d-w)*w` (= `d*w - w*(w-1)/2`); non-causal windowed (`|i-j| < w`):
    twice that minus `d`.
    """
    d = np.asarray(lengths, dtype=np.float64)
    if window is None:
        return d * (d + 1.0) / 2.0 if causal else d * d
    w = float(window)
    one_way = np.where(d <= w, d * (d + 1.0) / 2.0, w * (w + 1.0) / 2.0 + (d - w) * w)
    return one_way if causal else 2.0 * one_way - d
