"""Layout- and communication-aware time prediction of micro-batches and whole plans: `micro_batch_time` (the slowest
CP rank of one micro-batch, from balancer.planning.cost.microbatch's per-rank terms) and `predict_plan` (every
micro-batch of a plan, assembled into steps with the 1F1B formula of balancer.planning.metrics). The model and its
derivation: balancer.planning.cost.microbatch and docs/cost-model.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import ArrayLike

from balancer.planning import metrics
from balancer.planning.cost.hybrid import explicit_layout
from balancer.planning.cost.microbatch import (
    MicroBatchTerms,
    micro_batch_terms,
    rank_times,
    ring_moved,
    split_document_terms,
)
from balancer.planning.cost.model import CostModel

if TYPE_CHECKING:
    from balancer.planning.plans.plan import Plan


def _terms(lengths, cp: int, layout: str, cost: CostModel, layout_options: dict) -> MicroBatchTerms:
    """`micro_batch_terms` with a cost-driven hybrid choice (`cost=` among the options) made for these documents."""
    if layout == "hybrid" and "cost" in layout_options and cp > 1:
        layout_options = explicit_layout(lengths, cp, {"kind": "hybrid", **layout_options})
        layout_options.pop("kind")
    elif "cost" in layout_options:
        layout_options = {k: v for k, v in layout_options.items() if k not in ("cost", "method")}
    return micro_batch_terms(lengths, cp, layout, cost.causal, cost.window, **layout_options)


def micro_batch_time(
    cost: CostModel, lengths: ArrayLike, cp: int, layout: str = "zigzag", method: str = "ring", **layout_options: Any
) -> float:
    """Predicted time of one micro-batch: the slowest CP rank's `rank_times`."""
    terms = _terms(lengths, cp, layout, cost, layout_options)
    return float(rank_times(cost, terms, method).max())


def micro_batch_times(
    cost: CostModel, lengths: np.ndarray, ptr: np.ndarray, cp: int, method: str = "ring"
) -> np.ndarray:
    """`micro_batch_time` (zigzag layout) of many micro-batches at once: micro-batch k holds the documents
    `lengths[ptr[k]:ptr[k + 1]]` (none empty). Vectorised over documents, in blocks that bound the memory."""
    lengths = np.asarray(lengths, dtype=np.int64)
    ptr = np.asarray(ptr, dtype=np.int64)
    if cp == 1:  # one rank: no layout, no traffic
        return np.add.reduceat(cost.cost(lengths), ptr[:-1]) + cost.fixed
    out = np.empty(len(ptr) - 1)
    per_block = max(1, (1 << 21) // (4 * cp * cp))  # documents per block: [docs, 2cp, 2cp] stays ~16 MB
    first = 0
    while first < len(out):
        last = max(first + 1, int(np.searchsorted(ptr, ptr[first] + per_block, side="right")) - 1)
        last = min(last, len(out))
        a, b = ptr[first], ptr[last]
        pairs, pieces, travel = split_document_terms(lengths[a:b], cp, "zigzag", cost.causal, cost.window)
        starts = ptr[first:last] - a
        pairs, pieces, travel = (np.add.reduceat(x, starts, axis=0) for x in (pairs, pieces, travel))
        terms = MicroBatchTerms(travel, pairs, pieces, travel)
        out[first:last] = rank_times(cost, terms, method).max(axis=-1)
        first = last
    return out


def layout_kind(layout: str | dict, options: dict) -> tuple[str, dict]:
    """(kind, options) of a layout given by kind or as a plan's recorded layout `{"kind": ..., options}`, whose
    options `options` extend."""
    if not isinstance(layout, dict):
        return layout, options
    return str(layout.get("kind", "zigzag")), {**{k: v for k, v in layout.items() if k != "kind"}, **options}


def predict_plan(
    plan: Plan,
    cost: CostModel | None = None,
    layout: str | dict = "zigzag",
    method: str = "ring",
    **layout_options: Any,
) -> dict:
    """Layout- and communication-aware report of a Plan (its own cost model unless `cost` is given).

    Returns a dict: `layout` ({"kind", options}), `method`, `micro_batch_times` [steps, dp, M] (slowest CP rank),
    `step_times` [steps] (1F1B over each replica, slowest replica), `step_time_total`, `compute_only_total` (the
    section-3 step time total under the same cost model, for comparison), `kv_tokens_moved` and `kv_bytes_moved`
    (K/V token-hops summed over CP ranks and ring steps; bytes when the model knows `kv_bytes_per_token`),
    `attention_pieces` (document pieces summed over ranks and steps).
    """
    layout, layout_options = layout_kind(layout, layout_options)
    cost = plan.cost_model if cost is None else cost
    topo = plan.topology
    n_mb = len(plan.mb_ptr) - 1
    times = np.zeros(n_mb)
    moved = pieces = 0.0
    sizes = plan.end - plan.start
    for k in range(n_mb):
        lengths = sizes[plan.mb_ptr[k] : plan.mb_ptr[k + 1]]
        terms = _terms(lengths, topo.cp, layout, cost, layout_options)
        times[k] = rank_times(cost, terms, method).max()
        pieces += terms.pieces.sum()
        if topo.cp > 1:
            moved += ring_moved(terms).sum() if method == "ring" else (topo.cp - 1) * terms.travel.max() * topo.cp
    mb_times = plan.by_step(times)  # [steps, dp, M]; a short last step's missing micro-batches 0
    # replica_times takes per-micro-batch costs before the division by cp; these are already per rank
    step = metrics.step_times(mb_times * topo.cp, topo)
    entry = cost.cost(sizes)
    mb_cost = np.add.reduceat(np.append(entry, 0.0), plan.mb_ptr[:-1]) + cost.fixed
    section3 = float(metrics.step_times(plan.by_step(mb_cost), topo).sum())
    return {
        "layout": {"kind": layout, **layout_options},
        "method": method,
        "micro_batch_times": mb_times,
        "step_times": step,
        "step_time_total": float(step.sum()),
        "compute_only_total": section3,
        "kv_tokens_moved": float(moved),
        "kv_bytes_moved": float(moved * cost.kv_bytes_per_token) if cost.kv_bytes_per_token else None,
        "attention_pieces": float(pieces),
    }
