"""The balance metrics (docs/design.md, "Metrics"), defined once: Plan.metrics(), benchmarks and telemetry call them.

Times are in cost-model units per CP rank. A micro-batch holding documents D costs each rank of its CP group
`(sum cost(d) + fixed) / cp`; a replica's step time with P pipeline stages is `(P - 1) * max_m t_m + sum_m t_m`;
a step's time is the slowest replica's. With `fixed > 0` the lower bounds count `fixed` once for every one of the
`dp * micro_batches` micro-batches a step must run (with `fixed = 0`, the default, they are exactly section 3's).
"""

from __future__ import annotations

import numpy as np

from .cost import CostModel
from .topology import Topology


def one_f_one_b(largest, total, stages: int, *added):
    """The 1F1B replica time `(P - 1) * largest + total` (+ each of `added`, in order), for scalars or arrays.

    `largest` is the replica's largest micro-batch time, `total` the sum of its micro-batch times (with dynamic CP:
    the rank's finish time). Every evaluation of the formula, including the planner's vectorised candidate
    searches (`added` carries a candidate's change, summed left to right), goes through here.
    """
    time = (stages - 1) * largest + total
    for extra in added:
        time = time + extra
    return time


def replica_times(mb_cost: np.ndarray, topology: Topology) -> np.ndarray:
    """[steps, dp, M] micro-batch costs (fixed included) -> [steps, dp] per-CP-rank replica times."""
    t = np.asarray(mb_cost, dtype=np.float64) / topology.cp
    return one_f_one_b(t.max(axis=-1), t.sum(axis=-1), topology.pp)


def step_times(mb_cost: np.ndarray, topology: Topology) -> np.ndarray:
    """[steps, dp, M] micro-batch costs -> [steps] step times (the slowest replica)."""
    return replica_times(mb_cost, topology).max(axis=-1)


def lower_bound(
    work: np.ndarray | float, max_cost: np.ndarray | float, topology: Topology, fixed: float = 0.0, steps: int = 1
) -> np.ndarray:
    """`max(W / (DP*CP) * (1 + (P-1)/M), P * max_d cost(d) / CP)` for each step (or, with `steps`, the epoch)."""
    t = topology
    work = np.asarray(work, dtype=np.float64) + fixed * t.dp * t.micro_batches * steps
    spread = work / (t.dp * t.cp) * (1.0 + (t.pp - 1) / t.micro_batches)
    single = t.pp * (np.asarray(max_cost, dtype=np.float64) + fixed) / t.cp
    return np.maximum(spread, single)


def natural_steps(order: np.ndarray, lengths: np.ndarray, tokens_per_step: int) -> np.ndarray:
    """Step each document would land in if the shuffled `order` were cut every `tokens_per_step` tokens.

    Returns an int64 array indexed by document id; `mean_delay_steps` measures moves away from it.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    before = np.cumsum(lengths[order]) - lengths[order]
    natural = np.empty(len(order), dtype=np.int64)
    natural[order] = before // int(tokens_per_step)
    return natural


def summarize(
    mb_cost: np.ndarray,
    step_work: np.ndarray,
    step_max: np.ndarray,
    topology: Topology,
    cost: CostModel,
    *,
    total_tokens: int,
    padding_tokens: int = 0,
    dropped_tokens: int = 0,
    delay_steps: np.ndarray | None = None,
    plan_seconds: float = float("nan"),
) -> dict:
    """All section-3 metrics from per-micro-batch costs [steps, dp, M] and per-step work / max document cost."""
    mb_cost = np.asarray(mb_cost, dtype=np.float64)
    steps = mb_cost.shape[0]
    t_step = step_times(mb_cost, topology)
    lb_step = lower_bound(step_work, step_max, topology, cost.fixed)
    lb_epoch = float(lower_bound(np.sum(step_work), np.max(step_max), topology, cost.fixed, steps)) if steps else 0.0
    capacity_used = steps * topology.capacity
    total_t = float(t_step.sum())
    return {
        "steps": int(steps),
        "imbalance": float(total_t / lb_step.sum()) if steps else 1.0,
        "worst_step": float(np.max(t_step / lb_step)) if steps else 1.0,
        "epoch_efficiency": float(lb_epoch / total_t) if steps else 1.0,
        "token_utilization": float(total_tokens / capacity_used) if capacity_used else 0.0,
        "padding_tokens": int(padding_tokens),
        "dropped_tokens": int(dropped_tokens),
        # unknown (nan) for a plan that does not record where its documents would naturally have gone
        "mean_delay_steps": (float(np.mean(delay_steps)) if len(delay_steps) else 0.0)
        if delay_steps is not None
        else float("nan"),
        "plan_seconds": float(plan_seconds),
        "step_time_total": total_t,
        "lower_bound_epoch": lb_epoch,
    }
