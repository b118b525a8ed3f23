"""The cost-driven choice of a hybrid CP split: which documents of a micro-batch to split over the CP group so that
the predicted time of the slowest rank is least, zigzag (every document split) included.

The candidates are the hybrid placement's (`attention.placement.candidate_counts`: 0, 1, 2, 3, 4, 6, 9, ... longest
documents, then all of them), each placed by the same deterministic rule as `attention.CPLayout`, and timed with
this package's layout-aware terms (`microbatch.assignment_terms`, `rank_times`). The answer is an explicit split
set, which `CPLayout.build(..., kind="hybrid", split=...)` takes as it is: the attention package never sees a cost
model.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from attention.placement import Loads, candidate_counts, check_options, place_fitting
from balancer.planning.cost.microbatch import assignment_terms, rank_times
from balancer.planning.cost.model import CostModel

PREDICT_METHODS = ("ring", "allgather")


def _cost_model(cost) -> CostModel:
    """A cost model given as a `CostModel` or its `to_dict()`."""
    if isinstance(cost, CostModel):
        return cost
    if not isinstance(cost, dict):
        raise ValueError(f"cost must be a balancer.CostModel or its to_dict(), got {type(cost).__name__}")
    unknown = set(cost) - set(CostModel.__dataclass_fields__)
    if unknown:
        raise ValueError(f"cost has unknown field(s) {sorted(unknown)}")
    return CostModel.from_dict(cost)


def hybrid_split(
    lengths: ArrayLike, cp: int, cost: CostModel | dict, method: str = "ring", max_tokens: int | None = None
) -> np.ndarray:
    """bool [n_docs]: the split set of the candidate with the least predicted slowest-rank time under `cost` (a
    `CostModel` or its dict) for attention `method` ("ring" or "allgather"); ties go to the fewer splits. Documents
    `lengths` in packing order; `max_tokens` per CP rank as the layout's option."""
    lens = np.asarray(lengths, dtype=np.int64)
    if method not in PREDICT_METHODS:
        raise ValueError(f"method must be one of {PREDICT_METHODS}, got {method!r}")
    max_tokens = check_options(None, max_tokens, None)["max_tokens"]
    model = _cost_model(cost)
    n = lens.shape[0]
    if cp <= 1 or n == 0:
        return np.ones(n, dtype=bool)
    loads = Loads(lens, cp)
    order = [int(i) for i in np.argsort(-lens, kind="stable")]
    best: tuple[float, np.ndarray] | None = None
    for count in candidate_counts(n):
        cand = np.zeros(n, dtype=bool)
        cand[order[:count]] = True
        split, doc_rank, _ = place_fitting(loads, cand, order, max_tokens)
        whole_rank = np.maximum(np.asarray(doc_rank, dtype=np.int64), 0)
        terms = assignment_terms(lens, cp, split, whole_rank, model.causal, model.window)
        t = float(rank_times(model, terms, method).max())
        if best is None or t < best[0]:
            best = (t, split)
    assert best is not None, "candidate_counts yields at least one count"
    return best[1]


def check_cost_spec(spec: dict) -> dict:
    """A cost-driven hybrid spec, validated and normalised: `{"kind": "hybrid", "cost": <CostModel dict>, "method":
    "ring" | "allgather", "max_tokens": int | None}` (ValueError names the bad key)."""
    unknown = set(spec) - {"kind", "cost", "method", "max_tokens", "split_threshold", "tolerance"}
    if unknown or spec.get("kind") != "hybrid":
        raise ValueError(f"a cost-driven layout spec is {{'kind': 'hybrid', 'cost', 'method', 'max_tokens'}}: {spec!r}")
    if spec.get("split_threshold") is not None or spec.get("tolerance") is not None:
        raise ValueError("cost chooses the split documents by prediction: give it without split_threshold/tolerance")
    method = spec.get("method") or "ring"
    if method not in PREDICT_METHODS:
        raise ValueError(f"method must be None or one of {PREDICT_METHODS}, got {spec.get('method')!r}")
    max_tokens = check_options(None, spec.get("max_tokens"), None)["max_tokens"]
    return {"kind": "hybrid", "cost": _cost_model(spec["cost"]).to_dict(), "method": method, "max_tokens": max_tokens}


def explicit_layout(lengths: ArrayLike, cp: int, spec: dict) -> dict:
    """A layout spec with any cost-driven choice made: `{"kind": "hybrid", "cost": ..., "method": ...,
    "max_tokens": ...}` (as plan files before explicit splits record it) becomes `{"kind": "hybrid", "split":
    [document indices], "max_tokens": ...}` for these documents (`lengths` in packing order); any other spec is
    returned unchanged."""
    if not isinstance(spec, dict) or spec.get("cost") is None:
        return dict(spec)
    spec = check_cost_spec(spec)
    split = hybrid_split(lengths, cp, spec["cost"], spec["method"], spec["max_tokens"])
    return {"kind": "hybrid", "split": np.nonzero(split)[0].tolist(), "max_tokens": spec["max_tokens"]}
