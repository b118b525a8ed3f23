"""Layout-aware times of many document groups at once, from per-group sums instead of per-document matrices.

Under the zigzag layout a document of `L = 2*cp*b + k` tokens (`0 <= k < 2*cp`) has chunks of `b` or `b + 1`
tokens, which chunks get the extra token depending on `k` only. So its per-rank terms (cost/microbatch.py:
`pairs[r, s]`, `travel[s]`) are polynomials in `b` whose coefficients depend on `k`: quadratic for pairs, linear for
travel; and its `pieces[r, s]` are all one when `b >= 1`, a table of `k` when `b = 0`. Summed over a group's
documents, the terms are then a few per-`k` sums (count, sum of b, sum of b^2) times small tables. The tables are
derived from `microbatch.split_document_terms` itself (and checked against it at two more points), and every sum
is of integers below 2**53, so the terms, and the times `rank_times` computes from them, equal
`predict.micro_batch_time` exactly. Only causal or full attention without a window (the polynomial form); other
models return None from `zigzag_sums`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Optional

import numpy as np

from balancer.planning.cost.microbatch import MicroBatchTerms, rank_times, split_document_terms
from balancer.planning.cost.model import CostModel
from balancer.planning.packing.rowops import product

BLOCK = 1 << 22  # groups per block: [groups, cp, cp] float64 arrays stay ~32 MB


@functools.lru_cache(maxsize=32)
def _tables(cp: int, causal: bool):
    """(quadratic, linear, constant) pair tables [2cp, cp*cp], travel (slope, constant) [2cp, cp], short-document
    pieces [2cp, cp*cp]; None when the polynomial form does not reproduce split_document_terms."""
    n = 2 * cp
    k = np.arange(n)

    def terms(b: int):
        lengths = np.maximum(b * n + k, 1)  # b = 0, k = 0 is no document: its row is zeroed by the caller
        pairs, pieces, travel = split_document_terms(lengths, cp, "zigzag", causal, None)
        return pairs.reshape(n, cp * cp), pieces.reshape(n, cp * cp), travel

    (p1, _, t1), (p2, _, t2), (p3, _, _) = terms(1), terms(2), terms(3)
    quad = (p3 - 2 * p2 + p1) / 2
    lin = p2 - p1 - 3 * quad
    const = p1 - quad - lin
    slope, t_const = t2 - t1, 2 * t1 - t2
    for b in (0, 7):  # the form must hold at b = 0 (short documents) and beyond the fitted points
        pairs, _, travel = terms(b)
        if b == 0:
            pairs[0], travel[0] = const[0], t_const[0]
        if not (np.array_equal(pairs, quad * b * b + lin * b + const) and np.array_equal(travel, slope * b + t_const)):
            return None
    short_pieces = terms(0)[1]
    short_pieces[0] = 0.0
    return quad, lin, const, slope, t_const, short_pieces


def zigzag_sums(cost: CostModel, cp: int) -> Optional[Callable[[np.ndarray, np.ndarray, int], np.ndarray]]:
    """A function `times(lengths, group, n_groups) -> [n_groups]` giving, for documents `lengths` (int64) assigned to
    groups `group` (int64 in [0, n_groups), every group non-empty), each group's `micro_batch_time` on `cp` ranks
    (zigzag layout, ring); None when this cost model's mask has no closed form here (a window)."""
    if cost.window is not None or cp < 2:
        return None
    tables = _tables(int(cp), bool(cost.causal))
    if tables is None:
        return None

    def times(lengths: np.ndarray, group: np.ndarray, n_groups: int) -> np.ndarray:
        out = np.empty(n_groups)
        per_block = max(1, BLOCK // (cp * cp))
        for first in range(0, n_groups, per_block):
            last = min(n_groups, first + per_block)
            sel = (group >= first) & (group < last) if (first or last < n_groups) else slice(None)
            out[first:last] = _block_times(cost, cp, lengths[sel], group[sel] - first, last - first, tables)
        return out

    return times


def _block_times(cost: CostModel, cp: int, lengths: np.ndarray, group: np.ndarray, groups: int, tables) -> np.ndarray:
    quad, lin, const, slope, t_const, short_pieces = tables
    n = 2 * cp
    b, k = np.divmod(lengths, n)
    index = group * n + k
    size = groups * n
    count = np.bincount(index, minlength=size).reshape(groups, n).astype(np.float64)
    sum_b = np.bincount(index, weights=b.astype(np.float64), minlength=size).reshape(groups, n)
    sum_b2 = np.bincount(index, weights=(b * b).astype(np.float64), minlength=size).reshape(groups, n)
    short = b == 0
    short_count = np.bincount(index[short], minlength=size).reshape(groups, n).astype(np.float64)
    pairs = product(sum_b2, quad) + product(sum_b, lin) + product(count, const)
    travel = product(sum_b, slope) + product(count, t_const)
    pieces = product(short_count, short_pieces) + (count.sum(axis=1) - short_count.sum(axis=1))[:, None]
    terms = MicroBatchTerms(travel, pairs.reshape(groups, cp, cp), pieces.reshape(groups, cp, cp), travel)
    return rank_times(cost, terms, "ring").max(axis=-1)
