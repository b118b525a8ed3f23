"""One micro-batch on a CP group: what each rank holds and computes under a real CP layout, and its time.

Section-3 metrics (`Plan.metrics`) charge every CP rank `sum cost(d) / cp`. This module instead places the documents
by the chunk geometry `attention.CPLayout` shards by (`attention.geometry`; zigzag: every document in `2*cp`
chunks; hybrid: short documents whole on one rank, long ones zigzag-split) and charges each rank r
(docs/cost-model.md has the full derivation):

    t_r = fixed + linear_coef * tokens_r + sum over ring steps i of
          [ max(attn_coef * pairs[r, s_i] + piece_coef * pieces[r, s_i], comm_coef * moved_{r,i}) + comm_latency ]

(`comm_overlap=False`: the sum of the two instead of the max)
with `s_i = (r - i) mod cp` the rank whose K/V rank r holds at step i, `pairs[r, s]` the (query, key) pairs between
rank r's queries and rank s's keys (windowed if the model has a window), `pieces[r, s]` the documents with such
pairs, and `moved_{r,i}` the K/V tokens rank r sends and receives at that step (the larger of the two blocks; only
split documents' tokens travel). All-gather: `t_r = fixed + linear * tokens_r + sum_s compute[r, s]
+ comm_coef * (cp - 1) * max_s travel_s + comm_latency` (the gather is padded to the largest rank and, with one
head group, not overlapped). With cp = 1 there is no communication and t is section 3's cost plus piece overhead.
A micro-batch takes `max_r t_r` (`balancer.planning.cost.predict` assembles micro-batches into steps).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import ArrayLike

from attention.geometry import KINDS, block_pairs, chunk_bounds, chunk_sizes
from attention.placement import check_options, hybrid_assignment

if TYPE_CHECKING:  # annotations only: the cost model is built above this module (CostModel.fit uses it)
    from balancer.planning.cost.model import CostModel

METHODS = ("ring", "allgather")


@dataclass(frozen=True)
class MicroBatchTerms:
    """Cost-free quantities of one micro-batch under a layout: `tokens` [cp] local tokens per rank, `pairs`
    [cp, cp] attention pairs of rank r's queries against rank s's keys, `pieces` [cp, cp] documents with such
    pairs, `travel` [cp] tokens of rank s whose K/V must travel (split documents only)."""

    tokens: np.ndarray
    pairs: np.ndarray
    pieces: np.ndarray
    travel: np.ndarray

    @property
    def cp(self) -> int:
        return int(self.tokens.shape[-1])


def _check_layout_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"layout must be one of {KINDS}, got {kind!r}")


def _zigzag_chunks(lengths: np.ndarray, cp: int, kind: str = "zigzag"):
    """Chunk boundaries [n, k+1] and owner rank [k] of documents split by the zigzag (or contiguous) rule."""
    sizes, owner = chunk_sizes(lengths, cp, kind)
    return chunk_bounds(sizes), owner


def hybrid_placement(lengths: np.ndarray, cp: int, **layout_options: Any) -> tuple[np.ndarray, np.ndarray]:
    """(split bool [n], whole_rank int64 [n]) of the hybrid layout with these options, as `attention.CPLayout`
    places them. A cost-driven spec (`cost=`, `method=`) is resolved into an explicit `split` first
    (`balancer.planning.cost.hybrid.explicit_layout`; `predict.py` does it per micro-batch)."""
    layout_options = dict(layout_options)
    if "cost" in layout_options:
        raise ValueError(
            "a cost-driven hybrid layout needs resolving per micro-batch: explicit_layout(lengths, cp, spec)"
        )
    options = check_options(
        layout_options.pop("split_threshold", None),
        layout_options.pop("max_tokens", None),
        layout_options.pop("tolerance", None),
        layout_options.pop("split", None),
    )
    if layout_options:
        raise ValueError(f"unknown hybrid layout option(s) {sorted(layout_options)}")
    split, doc_rank = hybrid_assignment(lengths, cp, options)
    return split, np.maximum(doc_rank, 0)


def micro_batch_terms(
    lengths: ArrayLike,
    cp: int,
    layout: str = "zigzag",
    causal: bool = True,
    window: int | None = None,
    **layout_options: Any,
) -> MicroBatchTerms:
    """Terms of one micro-batch of documents `lengths` (in packing order) on `cp` ranks with this layout kind.

    Split documents follow the zigzag rule; whole documents (hybrid) sit on the rank the layout gives them.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim != 1 or len(lengths) == 0 or np.any(lengths < 1):
        raise ValueError("micro_batch_terms: lengths must be a non-empty 1-D array of positive token counts")
    if int(cp) != cp or cp < 1:
        raise ValueError(f"cp must be a positive integer, got {cp!r}")
    cp = int(cp)
    _check_layout_kind(layout)
    n = len(lengths)
    split = np.ones(n, dtype=bool)
    whole_rank = np.zeros(n, dtype=np.int64)
    if layout not in ("zigzag", "contiguous") and cp > 1:
        split, whole_rank = hybrid_placement(lengths, cp, **layout_options)
    elif layout_options and layout != "hybrid":
        raise ValueError(f"{sorted(layout_options)} are options of the hybrid layout only, not of {layout!r}")
    return assignment_terms(lengths, cp, split, whole_rank, causal, window, contiguous=layout == "contiguous")


def assignment_terms(
    lengths: np.ndarray,
    cp: int,
    split: np.ndarray,
    whole_rank: np.ndarray,
    causal: bool = True,
    window: int | None = None,
    contiguous: bool = False,
) -> MicroBatchTerms:
    """Terms of documents `lengths` (int64, positive) on `cp` ranks when documents with `split` True are cut by the
    zigzag (or `contiguous`) rule and every other one sits whole on `whole_rank` (the hybrid placement's answer;
    `attention.placement` compares its candidates with this)."""
    tokens = np.zeros(cp, dtype=np.float64)
    pairs = np.zeros((cp, cp), dtype=np.float64)
    pieces = np.zeros((cp, cp), dtype=np.float64)
    whole = ~split
    if whole.any():
        w_len = lengths[whole]
        np.add.at(tokens, whole_rank[whole], w_len)
        np.add.at(pairs, (whole_rank[whole], whole_rank[whole]), block_pairs(0, w_len, 0, w_len, causal, window))
        np.add.at(pieces, (whole_rank[whole], whole_rank[whole]), 1.0)
    travel = np.zeros(cp, dtype=np.float64)
    if split.any():
        s_len = lengths[split]
        doc_pairs, doc_pieces, doc_travel = split_document_terms(
            s_len, cp, "contiguous" if contiguous else "zigzag", causal, window
        )
        travel += doc_travel.sum(axis=0)
        tokens += travel
        pairs += doc_pairs.sum(axis=0)
        pieces += doc_pieces.sum(axis=0)
    if cp == 1:
        travel[:] = 0.0
    return MicroBatchTerms(tokens, pairs, pieces, travel)


def split_document_terms(
    lengths: np.ndarray, cp: int, kind: str, causal: bool, window: int | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per split document (zigzag or contiguous chunks): pairs [n, cp, cp] of rank r's queries against rank s's keys,
    pieces [n, cp, cp] (1 where there are such pairs) and tokens [n, cp] on each rank."""
    bounds, owner = _zigzag_chunks(lengths, cp, kind)
    lo, hi = bounds[:, :-1].astype(np.float64), bounds[:, 1:].astype(np.float64)
    rank_of = np.eye(cp)[owner]  # [chunk, rank] one-hot
    travel = (hi - lo) @ rank_of
    if causal and window is None:  # chunks in document order: a query chunk sees every key of the chunks before it
        size = hi - lo
        spread = size[:, :, None] * rank_of  # [n, a, s]: chunk a's tokens, in its owner's column
        before = np.cumsum(spread, axis=1) - spread  # [n, a, s]: rank s's tokens in the chunks before chunk a

        def by_owner(x):  # [n, a, s] summed over the chunks a of each rank r -> [n, r, s]
            return np.stack([x[:, owner == r].sum(axis=1) for r in range(cp)], axis=1)

        pairs = by_owner(size[:, :, None] * before)
        seen = by_owner(((size > 0)[:, :, None] & (before > 0)).astype(np.float64))
        diagonal = np.arange(cp)
        pairs[:, diagonal, diagonal] += (size * (size + 1) / 2) @ rank_of
        seen[:, diagonal, diagonal] += (size > 0) @ rank_of
        return pairs, (seen > 0).astype(np.float64), travel
    # every (query chunk a, key chunk b) pair of every document at once: [docs, a, b]
    p = block_pairs(lo[:, :, None], hi[:, :, None], lo[:, None, :], hi[:, None, :], causal, window)
    pieces = (rank_of.T @ (p > 0).astype(np.float64) @ rank_of > 0).astype(np.float64)
    return rank_of.T @ p @ rank_of, pieces, travel


def step_blocks(cp: int) -> np.ndarray:
    """[cp, cp] rank whose K/V rank r holds at ring step i: `(r - i) mod cp`."""
    r = np.arange(cp)[:, None]
    return (r - np.arange(cp)[None, :]) % cp


def ring_moved(terms: MicroBatchTerms) -> np.ndarray:
    """[cp, cp] K/V tokens moved by rank r during ring step i: the larger of the block sent and the one received."""
    held = step_blocks(terms.cp)
    return np.maximum(terms.travel[..., held], terms.travel[..., (held - 1) % terms.cp])


def rank_times(cost: CostModel, terms: MicroBatchTerms, method: str = "ring") -> np.ndarray:
    """[cp] predicted time of every CP rank for one micro-batch (see the module docstring); terms with leading
    batch dimensions (`micro_batch_times`) give [..., cp]."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    cp = terms.cp
    base = cost.fixed + cost.linear_coef * terms.tokens
    compute = cost.attn_coef * terms.pairs + cost.piece_coef * terms.pieces  # [..., r, s]
    if cp == 1:
        return base + compute.sum(axis=-1)
    if method == "allgather":
        gathered = cost.comm_coef * (cp - 1) * terms.travel.max(axis=-1, keepdims=True)
        return base + compute.sum(axis=-1) + gathered + cost.comm_latency
    held = step_blocks(cp)
    per_step = np.take_along_axis(compute, np.broadcast_to(held, compute.shape), axis=-1)  # [..., r, i]
    moved = cost.comm_coef * ring_moved(terms)
    step = np.maximum(per_step, moved) if cost.comm_overlap else per_step + moved
    return base + (step + cost.comm_latency).sum(axis=-1)


def stack_terms(terms: list) -> MicroBatchTerms:
    """Terms of several micro-batches of one CP size stacked along a leading axis (for `fit_features_batch`)."""
    return MicroBatchTerms(*(np.stack([getattr(t, f) for t in terms]) for f in ("tokens", "pairs", "pieces", "travel")))


def fit_features_batch(terms: MicroBatchTerms, method: str, cost: CostModel | None) -> np.ndarray:
    """[n, 6] linear features [pairs, tokens, 1, pieces, comm tokens, latency count] of the slowest rank of every
    micro-batch of `terms` (stacked by `stack_terms`: one CP size), with each ring step charged to compute or to
    transfer as `cost` says; both are counted when `cost` is None or does not overlap (the slowest rank is then the
    one with the most tokens)."""
    cp, n = terms.cp, len(terms.tokens)
    times = rank_times(cost, terms, method) if cost is not None else terms.tokens
    r = np.argmax(times, axis=-1)  # [n] the slowest rank (the first of ties, as argmax one by one)
    rows = np.arange(n)
    tokens, ones = terms.tokens[rows, r], np.ones(n)
    if cp == 1 or method == "allgather":
        comm = (cp - 1) * terms.travel.max(axis=-1) if cp > 1 else np.zeros(n)
        pairs, pieces = terms.pairs[rows, r].sum(axis=-1), terms.pieces[rows, r].sum(axis=-1)
        return np.stack([pairs, tokens, ones, pieces, comm, np.full(n, float(cp > 1))], axis=1)
    held = step_blocks(cp)[r]  # [n, cp]
    pairs = np.take_along_axis(terms.pairs[rows, r], held, axis=-1)
    pieces = np.take_along_axis(terms.pieces[rows, r], held, axis=-1)
    moved = ring_moved(terms)[rows, r]
    if cost is None or not cost.comm_overlap:  # compute and transfer both counted
        on_compute = np.ones(pairs.shape, dtype=bool)
        comm = moved.sum(axis=-1)
    else:
        on_compute = cost.attn_coef * pairs + cost.piece_coef * pieces >= cost.comm_coef * moved
        comm = np.where(on_compute, 0.0, moved).sum(axis=-1)
    pairs, pieces = np.where(on_compute, pairs, 0.0).sum(axis=-1), np.where(on_compute, pieces, 0.0).sum(axis=-1)
    return np.stack([pairs, tokens, ones, pieces, comm, np.full(n, float(cp))], axis=1)
