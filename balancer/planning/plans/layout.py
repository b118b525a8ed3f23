"""A plan's layout record: the CP layout its micro-batches are sharded with, so that an outside tool re-derives every
rank's share (docs/plan-format.md, "Layout record").

A record is a layout spec `{"kind": ..., <options>}` for every micro-batch alike, or, for a hybrid layout whose
split sets differ per micro-batch (the planner's cost-driven choice), `{"kind": "hybrid", "max_tokens": ...,
"splits": [[positions], ...]}`: one list per micro-batch in plan order, the positions (in the micro-batch's
placement order: whole documents, then spans) of its documents split over the CP group. Records written before
the splits became explicit carry the cost model instead (`{"kind": "hybrid", "cost": ..., "method": ...}`); they
load unchanged and resolve per micro-batch to the same split sets (`explicit_layout`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from attention.geometry import KINDS
from balancer.planning.cost.hybrid import check_cost_spec, explicit_layout

if TYPE_CHECKING:
    from balancer.planning.plans.plan import Plan


def _group_sizes(plan) -> np.ndarray:
    """int64 [micro-batches]: the CP size each micro-batch runs on."""
    n_mb = len(plan.mb_ptr) - 1
    return plan.group_size if plan.dynamic else np.full(n_mb, plan.topology.cp, dtype=np.int64)


def micro_batch_lengths(plan: Plan, k: int) -> np.ndarray:
    """int64: the token counts of micro-batch `k`'s placements, in placement order."""
    a, b = plan.mb_ptr[k], plan.mb_ptr[k + 1]
    return plan.end[a:b] - plan.start[a:b]


def check_record(plan: Plan, record: dict | None) -> dict | None:
    """`record` validated against `plan` (ValueError names the key): a known kind, and `splits` with one increasing
    list of in-range positions per micro-batch."""
    if record is None:
        return None
    if not isinstance(record, dict) or record.get("kind") not in KINDS:
        raise ValueError(f"field 'layout' must be {{'kind': one of {KINDS}, ...}}, got {record!r}")
    if record.get("cost") is not None:
        return check_cost_spec(record)
    splits = record.get("splits")
    if splits is None:
        return dict(record)
    sizes = np.diff(plan.mb_ptr)
    if record["kind"] != "hybrid" or not isinstance(splits, list) or len(splits) != len(sizes):
        raise ValueError(f"field 'layout.splits' must be a hybrid layout's list of {len(sizes)} position lists")
    for k, (positions, size) in enumerate(zip(splits, sizes)):
        ok = isinstance(positions, list) and all(isinstance(p, int) and not isinstance(p, bool) for p in positions)
        if not ok or (positions and (positions[0] < 0 or positions[-1] >= size or np.any(np.diff(positions) <= 0))):
            raise ValueError(f"field 'layout.splits[{k}]' must list increasing positions in 0..{size - 1}")
    return dict(record)


def with_explicit_splits(plan: Plan, spec: dict) -> dict | None:
    """The record for `spec`: a cost-driven hybrid spec becomes its explicit per-micro-batch split sets; any other
    spec is recorded as it is."""
    record = check_record(plan, spec)
    if record is None or record.get("cost") is None:
        return record
    cps = _group_sizes(plan)
    splits = [
        explicit_layout(micro_batch_lengths(plan, k), int(cps[k]), record)["split"] if cps[k] > 1 else []
        for k in range(len(plan.mb_ptr) - 1)
    ]
    return {"kind": "hybrid", "max_tokens": record["max_tokens"], "splits": splits}


def micro_batch_layout(plan: Plan, k: int) -> dict:
    """The explicit layout spec of micro-batch `k` (`attention.CPLayout.from_spec` takes it): the record's own spec,
    its split set for `k`, or the cost-driven choice made for `k`'s documents; zigzag without a record."""
    record = plan.layout
    if record is None:
        return {"kind": "zigzag"}
    if record.get("splits") is not None:
        return {"kind": "hybrid", "split": record["splits"][k], "max_tokens": record.get("max_tokens")}
    return explicit_layout(micro_batch_lengths(plan, k), int(_group_sizes(plan)[k]), record)
