"""Hybrid CP layout: which documents are split over the whole CP group and on which rank each whole document lives.

Pure functions of (document lengths, cp_size, options), with exact integer arithmetic, so every rank, the collator
and the planner derive the same answer without communicating. See ``docs/cp-layouts.md`` for the rules.

Load of a rank: its tokens ``t_r`` and its causal attention pairs ``p_r`` (split documents contribute their zigzag
shares). With ``T`` and ``W`` the batch's total tokens and pairs, a rank's *relative load* is
``max(p_r / (W/cp), t_r / (T/cp))``: 1.0 on every rank is a perfect balance of both attention and per-token work.

Placement of whole documents (greedy, longest first, ties by document index): each goes to the rank whose relative
load after taking it is smallest (ties: lowest rank) among the ranks it fits on (``t_r + d <= max_tokens``). A
document that fits on no rank is split instead, and placement restarts with the larger split set. So is the longest
whole document (of 2 tokens or more) while some rank would hold no token at all: a rank with an empty shard cannot
run most models' forward pass.

Split set: an explicit one (``split``: the document indices to split, as a plan records it), or documents longer
than ``split_threshold`` tokens when one is given. Without either (the default), the fewest longest documents are
split such that the relative load of every rank is at most ``1 + tolerance`` (default ``DEFAULT_TOLERANCE``):
candidates 0, 1, 2, 3, 4, 6, 9, 13, ... longest documents are tried in turn (:func:`candidate_counts`). Choosing the
split set by a cost model's prediction is the planner's job (``balancer.planning.cost.hybrid``), which hands the
layout its answer as an explicit ``split``; the placement of whole documents is the same either way.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from fractions import Fraction
from typing import Optional

import numpy as np

from attention.geometry import causal_pairs, chunk_owner, rank_shares, zigzag_sizes

DEFAULT_TOLERANCE = 0.02


def _check_int_option(name: str, value, lowest: int) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lowest:
        raise ValueError(f"{name} must be None or an int >= {lowest}, got {value!r}")
    return int(value)


def check_options(
    split_threshold: Optional[int],
    max_tokens: Optional[int],
    tolerance: Optional[float],
    split: Optional[Sequence[int]] = None,
) -> dict:
    """Validated hybrid options as a plain dict (the layout spec's options); ValueError names the bad option.
    ``split`` (document indices, increasing) appears in the dict only when given (specs without one are
    unchanged)."""
    split_threshold = _check_int_option("split_threshold", split_threshold, 1)
    max_tokens = _check_int_option("max_tokens", max_tokens, 1)
    if tolerance is not None:
        if split_threshold is not None:
            raise ValueError("tolerance applies only without split_threshold (it chooses the split documents)")
        if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance < 1e6:
            raise ValueError(f"tolerance must be None or a number >= 0, got {tolerance!r}")
        tolerance = float(tolerance)
    options = {"split_threshold": split_threshold, "max_tokens": max_tokens, "tolerance": tolerance}
    if split is None:
        return options
    if split_threshold is not None or tolerance is not None:
        raise ValueError("split names the split documents: give it without split_threshold/tolerance")
    return {**options, "split": _check_split(split)}


def _check_split(split) -> list[int]:
    """An explicit split set as increasing document indices (a bool mask is turned into its indices)."""
    values = np.asarray(split)
    if values.ndim != 1 or (values.size and values.dtype != bool and not np.issubdtype(values.dtype, np.integer)):
        raise ValueError(f"split must be a 1-D list of document indices or a bool mask, got {split!r}")
    idx = np.nonzero(values)[0] if values.dtype == bool else values.astype(np.int64)
    if idx.size and (idx.min() < 0 or np.any(np.diff(idx) <= 0)):
        raise ValueError("split must list distinct non-negative document indices in increasing order")
    return [int(i) for i in idx]


class Loads:
    """Per-rank tokens and pairs, and the exact comparison key of relative load (scaled by W*T)."""

    def __init__(self, lens: np.ndarray, cp: int) -> None:
        self.lens = [int(d) for d in lens]
        self.pairs = [int(p) for p in causal_pairs(self.lens)]
        self.total_tokens, self.total_pairs = max(sum(self.lens), 1), max(sum(self.pairs), 1)
        self.cp = cp

    def key(self, tokens: int, pairs: int) -> int:
        return max(pairs * self.total_tokens, tokens * self.total_pairs)

    def split_shares(self, split: np.ndarray) -> tuple[list[int], list[int]]:
        """Tokens and causal pairs every rank gets from the split documents."""
        idx = np.nonzero(split)[0]
        tokens, pairs = [0] * self.cp, [0] * self.cp
        if idx.size == 0:
            return tokens, pairs
        sizes = zigzag_sizes(np.asarray(self.lens, dtype=np.int64)[idx], self.cp)
        token_shares, pair_shares = rank_shares(sizes, chunk_owner(self.cp, "zigzag"), self.cp)
        return [int(x) for x in token_shares], [int(x) for x in pair_shares]


def _place_whole(loads: Loads, split: np.ndarray, order: list[int], max_tokens: Optional[int]):
    """Greedy placement of the whole documents (in ``order``). Returns (doc_rank list, rank keys) or the index of
    the first document that fits on no rank."""
    tokens, pairs = loads.split_shares(split)
    doc_rank = [-1] * len(loads.lens)
    for doc in order:
        if split[doc]:
            continue
        d, p = loads.lens[doc], loads.pairs[doc]
        best, best_key = -1, None
        for rank in range(loads.cp):
            if max_tokens is not None and tokens[rank] + d > max_tokens:
                continue
            k = loads.key(tokens[rank] + d, pairs[rank] + p)
            if best_key is None or k < best_key:
                best, best_key = rank, k
        if best < 0:
            return doc
        doc_rank[doc] = best
        tokens[best] += d
        pairs[best] += p
    return doc_rank, [loads.key(t, p) for t, p in zip(tokens, pairs)], tokens


def place_fitting(
    loads: Loads, split: np.ndarray, order: list[int], max_tokens: Optional[int]
) -> tuple[np.ndarray, list[int], list]:
    """Place whole documents, splitting each one that fits nowhere, and the longest whole one while a rank would
    be left without a token (then starting over). Returns (split, doc_rank, rank keys)."""
    split = split.copy()
    while True:
        res = _place_whole(loads, split, order, max_tokens)
        if not isinstance(res, tuple):
            split[res] = True
            continue
        doc_rank, keys, tokens = res
        spare = [doc for doc in order if not split[doc] and loads.lens[doc] >= 2]
        if min(tokens) > 0 or not spare:
            return split, doc_rank, keys
        split[spare[0]] = True


def candidate_counts(n: int) -> Iterator[int]:
    """The candidate split-set sizes: 0, 1, 2, 3, 4, 6, 9, 13, ... up to ``n`` (all documents)."""
    j = 0
    while j < n:
        yield j
        j = j + 1 if j < 4 else j + j // 2
    yield n


def hybrid_assignment(lens: np.ndarray, cp: int, options: dict) -> tuple[np.ndarray, np.ndarray]:
    """(split bool [n_docs], doc_rank int64 [n_docs], -1 for split documents) for the hybrid layout."""
    lens = np.asarray(lens, dtype=np.int64)
    n = lens.shape[0]
    loads = Loads(lens, cp)
    order = [int(i) for i in np.argsort(-lens, kind="stable")]
    threshold, max_tokens = options["split_threshold"], options["max_tokens"]
    if options.get("split") is not None:
        split, doc_rank = _explicit(loads, options["split"], order, max_tokens)
    elif threshold is not None:
        split, doc_rank, _ = place_fitting(loads, lens > threshold, order, max_tokens)
    else:
        tol = Fraction(DEFAULT_TOLERANCE if options["tolerance"] is None else options["tolerance"])
        limit = (1 + tol) * loads.total_tokens * loads.total_pairs  # relative load <= 1 + tol, scaled by W*T
        for count in candidate_counts(n):
            cand = np.zeros(n, dtype=bool)
            cand[order[:count]] = True
            split, doc_rank, keys = place_fitting(loads, cand, order, max_tokens)
            if max(keys) * cp <= limit:
                break
    _check_fits(loads, split, doc_rank, max_tokens)
    return split, np.asarray(doc_rank, dtype=np.int64)


def _explicit(loads: Loads, split_ids: list[int], order: list[int], max_tokens: Optional[int]):
    """Placement of whole documents around a given split set, which must be final: every whole document fits and
    no rank is left without a token (the split set a plan records, computed by the same rule)."""
    n = len(loads.lens)
    if split_ids and split_ids[-1] >= n:
        raise ValueError(f"split names document {split_ids[-1]} but the batch has {n} documents")
    split = np.zeros(n, dtype=bool)
    split[split_ids] = True
    placed, doc_rank, _ = place_fitting(loads, split, order, max_tokens)
    if not np.array_equal(placed, split):
        extra = sorted(set(np.nonzero(placed)[0].tolist()) - set(split_ids))
        raise ValueError(
            f"split {split_ids} is not a final split set for this batch: documents {extra} fit on no rank whole or "
            "a rank would hold no token (list them in split too)"
        )
    return split, doc_rank


def _check_fits(loads: Loads, split: np.ndarray, doc_rank, max_tokens: Optional[int]) -> None:
    if max_tokens is None:
        return
    tokens, _ = loads.split_shares(split)
    for doc, rank in enumerate(doc_rank):
        if rank >= 0:
            tokens[rank] += loads.lens[doc]
    if max(tokens) > max_tokens:
        raise ValueError(
            f"max_tokens={max_tokens} cannot hold this batch of {sum(loads.lens)} tokens on {loads.cp} CP ranks "
            f"(a rank would hold {max(tokens)} even with the longest documents split); raise max_tokens or send "
            "fewer tokens per micro-batch"
        )
