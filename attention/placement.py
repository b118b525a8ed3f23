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

Split set: documents longer than ``split_threshold`` tokens when one is given. Without one (the default), the fewest
longest documents are split such that the relative load of every rank is at most ``1 + tolerance`` (default
``DEFAULT_TOLERANCE``): candidates 0, 1, 2, 3, 4, 6, 9, 13, ... longest documents are tried in turn. Given a
``cost`` model (a ``balancer.CostModel`` with per-piece and communication terms, e.g. calibrated on the machine),
every candidate, all documents included (= zigzag), is placed and the one with the least predicted time of the
slowest rank (``planning.cost.microbatch``, for ``method``) is kept: where the prediction says keeping documents
whole loses, the layout is zigzag's.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Optional

import numpy as np

DEFAULT_TOLERANCE = 0.02


def zigzag_sizes(lens: np.ndarray, cp: int) -> np.ndarray:
    """int64 [n_docs, 2*cp]: zigzag chunk sizes (chunk j belongs to rank min(j, 2cp-1-j)); remainder tokens go to
    the first ``rem`` chunks when ``rem <= cp``, else to the last ``rem`` chunks."""
    nch = 2 * cp
    base, rem = lens // nch, lens % nch
    j = np.arange(nch)[None, :]
    extra = np.where((rem <= cp)[:, None], j < rem[:, None], j >= (nch - rem)[:, None])
    return base[:, None] + extra.astype(np.int64)


def _check_int_option(name: str, value, lowest: int) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lowest:
        raise ValueError(f"{name} must be None or an int >= {lowest}, got {value!r}")
    return int(value)


def check_options(split_threshold, max_tokens, tolerance, cost=None, method=None) -> dict:
    """Validated hybrid options as a plain dict (the layout spec's options); ValueError names the bad option.
    ``cost`` and ``method`` appear in the dict only when a cost model is given (specs without one are unchanged)."""
    split_threshold = _check_int_option("split_threshold", split_threshold, 1)
    max_tokens = _check_int_option("max_tokens", max_tokens, 1)
    if tolerance is not None:
        if split_threshold is not None:
            raise ValueError("tolerance applies only without split_threshold (it chooses the split documents)")
        if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance < 1e6:
            raise ValueError(f"tolerance must be None or a number >= 0, got {tolerance!r}")
        tolerance = float(tolerance)
    options = {"split_threshold": split_threshold, "max_tokens": max_tokens, "tolerance": tolerance}
    if cost is None:
        if method is not None:
            raise ValueError("method applies only with cost (the prediction it is for)")
        return options
    if split_threshold is not None or tolerance is not None:
        raise ValueError("cost chooses the split documents by prediction: give it without split_threshold/tolerance")
    if method not in (None, *PREDICT_METHODS):
        raise ValueError(f"method must be None or one of {PREDICT_METHODS}, got {method!r}")
    return {**options, "cost": _cost_dict(cost), "method": method or "ring"}


PREDICT_METHODS = ("ring", "allgather")


def _cost_dict(cost) -> dict:
    """A cost model (``balancer.CostModel`` or its ``to_dict()``) as a validated JSON-able dict."""
    from balancer.planning.cost.model import CostModel  # noqa: PLC0415 - only layouts given a cost model need balancer

    if isinstance(cost, CostModel):
        return cost.to_dict()
    if not isinstance(cost, dict):
        raise ValueError(f"cost must be a balancer.CostModel or its to_dict(), got {type(cost).__name__}")
    unknown = set(cost) - set(CostModel.__dataclass_fields__)
    if unknown:
        raise ValueError(f"cost has unknown field(s) {sorted(unknown)}")
    return CostModel.from_dict(cost).to_dict()


def predicted_time(lens: np.ndarray, cp: int, split: np.ndarray, doc_rank, cost: dict, method: str) -> float:
    """The slowest rank's predicted time (``balancer.planning.cost.microbatch``) of one split set and placement."""
    from balancer.planning.cost.microbatch import assignment_terms, rank_times  # noqa: PLC0415
    from balancer.planning.cost.model import CostModel  # noqa: PLC0415

    model = CostModel.from_dict(cost)
    whole_rank = np.maximum(np.asarray(doc_rank, dtype=np.int64), 0)
    terms = assignment_terms(lens, cp, split, whole_rank, model.causal, model.window)
    return float(rank_times(model, terms, method).max())


class _Loads:
    """Per-rank tokens and pairs, and the exact comparison key of relative load (scaled by W*T)."""

    def __init__(self, lens: np.ndarray, cp: int) -> None:
        self.lens = [int(d) for d in lens]
        self.pairs = [d * (d + 1) // 2 for d in self.lens]
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
        bounds = np.concatenate([np.zeros((idx.size, 1), np.int64), np.cumsum(sizes, axis=1)], axis=1)
        start, end = bounds[:, :-1], bounds[:, 1:]
        chunk_pairs = (end * (end + 1) - start * (start + 1)) // 2
        for j in range(2 * self.cp):
            rank = min(j, 2 * self.cp - 1 - j)
            tokens[rank] += int(sizes[:, j].sum())
            pairs[rank] += int(chunk_pairs[:, j].sum())
        return tokens, pairs


def _place_whole(loads: _Loads, split: np.ndarray, order: list[int], max_tokens: Optional[int]):
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


def _place_fitting(loads: _Loads, split: np.ndarray, order: list[int], max_tokens: Optional[int]):
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


def _candidate_counts(n: int):
    j = 0
    while j < n:
        yield j
        j = j + 1 if j < 4 else j + j // 2
    yield n


def hybrid_assignment(lens: np.ndarray, cp: int, options: dict) -> tuple[np.ndarray, np.ndarray]:
    """(split bool [n_docs], doc_rank int64 [n_docs], -1 for split documents) for the hybrid layout."""
    lens = np.asarray(lens, dtype=np.int64)
    n = lens.shape[0]
    loads = _Loads(lens, cp)
    order = [int(i) for i in np.argsort(-lens, kind="stable")]
    threshold, max_tokens = options["split_threshold"], options["max_tokens"]
    if threshold is not None:
        split, doc_rank, _ = _place_fitting(loads, lens > threshold, order, max_tokens)
    elif options.get("cost") is not None and cp > 1 and n:
        split, doc_rank = _least_predicted(loads, lens, cp, order, options)
    else:
        tol = Fraction(DEFAULT_TOLERANCE if options["tolerance"] is None else options["tolerance"])
        limit = (1 + tol) * loads.total_tokens * loads.total_pairs  # relative load <= 1 + tol, scaled by W*T
        for count in _candidate_counts(n):
            cand = np.zeros(n, dtype=bool)
            cand[order[:count]] = True
            split, doc_rank, keys = _place_fitting(loads, cand, order, max_tokens)
            if max(keys) * cp <= limit:
                break
    _check_fits(loads, split, doc_rank, max_tokens)
    return split, np.asarray(doc_rank, dtype=np.int64)


def _least_predicted(loads: _Loads, lens: np.ndarray, cp: int, order: list[int], options: dict):
    """The candidate split set (0, 1, 2, 3, 4, 6, 9, ... longest documents; all of them = zigzag) whose placement
    has the least predicted time under ``options["cost"]``; ties go to the fewer splits."""
    best = None
    for count in _candidate_counts(len(lens)):
        cand = np.zeros(len(lens), dtype=bool)
        cand[order[:count]] = True
        split, doc_rank, _ = _place_fitting(loads, cand, order, options["max_tokens"])
        t = predicted_time(lens, cp, split, doc_rank, options["cost"], options["method"])
        if best is None or t < best[0]:
            best = (t, split, doc_rank)
    return best[1], best[2]


def _check_fits(loads: _Loads, split: np.ndarray, doc_rank, max_tokens: Optional[int]) -> None:
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
