"""The balance metrics (docs/design.md, "Metrics"), defined once: Plan.metrics(), benchmarks and telemetry call them.

Times are in cost-model units per CP rank. A micro-batch holding documents D costs each rank of its CP group
`(sum cost(d) + fixed) / cp`; a replica's step time with P pipeline stages is `(P - 1) * max_m t_m + sum_m t_m`;
a step's time is the slowest replica's. With `fixed > 0` the lower bounds count `fixed` once for every one of the
`dp * micro_batches` micro-batches a step must run (with `fixed = 0`, the default, they are exactly section 3's).

Uneven ranks (`Topology.rank_speeds`, balancer.planning.speeds): a replica's time is divided by its speed, a
dynamic-CP group's by its slowest member's, and the bounds become
`max(W / (CP * sum(s)) * (1 + (P-1)/M), P * max_d cost(d) / (C * max(s)))`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from balancer.planning.cost.model import CostModel
from balancer.planning.packing.rowops import last_axis
from balancer.planning.speeds import group_speeds, pool_speeds
from balancer.planning.topology import Topology


def one_f_one_b(largest: Any, total: Any, stages: int, *added: Any) -> Any:  # floats or numpy arrays alike
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
    """[steps, dp, M] micro-batch costs (fixed included) -> [steps, dp] per-CP-rank replica times (each divided by
    its replica's speed when `rank_speeds` is set)."""
    t = np.asarray(mb_cost, dtype=np.float64) / topology.cp
    times = one_f_one_b(last_axis(np.maximum, t), last_axis(np.add, t), topology.pp)
    if topology.rank_speeds is not None:
        times = times / np.asarray(topology.rank_speeds)
    return times


def step_times(mb_cost: np.ndarray, topology: Topology) -> np.ndarray:
    """[steps, dp, M] micro-batch costs -> [steps] step times (the slowest replica)."""
    return replica_times(mb_cost, topology).max(axis=-1)


def lower_bound(
    work: np.ndarray | float,
    max_cost: np.ndarray | float,
    topology: Topology,
    fixed: float = 0.0,
    steps: int = 1,
    micro_batches: np.ndarray | int | None = None,
) -> np.ndarray:
    """`max(W / (DP*CP) * (1 + (P-1)/M), P * max_d cost(d) / C)` for each step (or, with `steps`, the epoch), C
    being the largest CP group: `cp`, or with dynamic CP `max(cp_sizes)`. `fixed` is counted once per micro-batch
    of the fewest a step can run (`dp * M`; dynamic: `M * dp * cp / max(cp_sizes)`). With `rank_speeds` s:
    `max(W / (CP * sum(s)) * (1 + (P-1)/M), P * max_d cost(d) / (C * max(s)))` (dynamic CP: s per pool rank,
    `W / sum(s)`). `micro_batches`: the micro-batches (slots) of each step, M by default; a short last step
    (M' < M) has the bubble share `(P-1)/M'` and `fixed` counted M' times; with `steps`, the epoch's total count of
    slots (the bubble share stays `(P-1)/M`, a bound for every step)."""
    t = topology
    groups_per_slot = t.dp if not t.dynamic else t.pool_size // t.largest_group
    m = t.micro_batches if micro_batches is None else np.asarray(micro_batches, dtype=np.float64)
    slots = m * steps if micro_batches is None or steps == 1 else m
    if steps != 1:
        m = t.micro_batches
    work = np.asarray(work, dtype=np.float64) + fixed * groups_per_slot * slots
    single = t.pp * (np.asarray(max_cost, dtype=np.float64) + fixed) / t.largest_group
    if t.rank_speeds is None:
        spread = work / (t.dp * t.cp) * (1.0 + (t.pp - 1) / m)
    else:
        speeds = pool_speeds(t)  # a replica's CP ranks share its speed: sum over the pool = CP * sum(s)
        assert speeds is not None, "rank_speeds is set"
        spread = work / float(speeds.sum()) * (1.0 + (t.pp - 1) / m)
        single = single / float(speeds.max())
    return np.maximum(spread, single)


def dynamic_step_times(
    group_cost: np.ndarray, group_start: np.ndarray, group_size: np.ndarray, slot_ptr: np.ndarray, topology: Topology
) -> np.ndarray:
    """Step times of a dynamic-CP plan ([steps]).

    Groups (cost with `fixed` included, first rank, size) are cut into slots by `slot_ptr`, `micro_batches` slots
    per step, each slot's groups sorted by first rank and covering the pool. A group takes `t_g = cost / size`
    and starts when all its ranks finished their previous slot; with P stages each rank pays `(P-1) * max_k t_g`
    once: `T_step = max over ranks ((P-1) * max_k t_g(r, k) + finish_r)`. A plan whose groups never change gives
    the static formula exactly. With `rank_speeds` a group's time is divided by its slowest member's speed.
    """
    pool, m = topology.pool_size, topology.micro_batches
    steps = -(-(len(slot_ptr) - 1) // m)  # a short last step has fewer than m slots
    group_time = np.asarray(group_cost, dtype=np.float64) / group_size
    if topology.rank_speeds is not None:
        group_time = group_time / group_speeds(pool_speeds(topology), group_start, group_size)
    slot_of_group = np.repeat(np.arange(len(slot_ptr) - 1), np.diff(slot_ptr))
    step_of_group = slot_of_group // m
    finish = np.zeros(steps * pool)
    largest = np.zeros(steps * pool)
    for k in range(m):
        members = np.flatnonzero(slot_of_group % m == k)
        if len(members) == 0:
            continue
        n = (int(step_of_group[members[-1]]) + 1) * pool  # a short last step has no slot k >= M': a prefix
        first_rank = step_of_group[members] * pool + group_start[members]
        start_time = np.maximum.reduceat(finish[:n], first_rank)
        finish[:n] = np.repeat(start_time + group_time[members], group_size[members])
        largest[:n] = np.maximum(largest[:n], np.repeat(group_time[members], group_size[members]))
    return one_f_one_b(largest, finish, topology.pp).reshape(steps, pool).max(axis=1)


def natural_steps(
    order: np.ndarray, lengths: np.ndarray, tokens_per_step: int, in_order: np.ndarray | None = None
) -> np.ndarray:
    """Step each document would land in if the shuffled `order` were cut every `tokens_per_step` tokens.

    Returns an int64 array indexed by document id; `mean_delay_steps` measures moves away from it. `in_order`:
    `lengths[order]` where the caller has it already (the same result, one gather less).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    in_order = lengths[order] if in_order is None else np.asarray(in_order, dtype=np.int64)
    before = np.cumsum(in_order)
    before -= in_order
    natural = np.empty(len(order), dtype=np.int64)
    natural[order] = before // int(tokens_per_step)
    return natural


def summarize(
    step_time: np.ndarray,
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
    micro_batches: np.ndarray | None = None,
) -> dict:
    """All section-3 metrics from the step times [steps] (`step_times` or `dynamic_step_times`) and per-step work /
    max document cost; with uneven ranks also `rank_speeds` (the topology's). `micro_batches`: each step's
    micro-batch count (None: M every step; a short last step: M' there, in its bound)."""
    t_step = np.asarray(step_time, dtype=np.float64)
    steps = len(t_step)
    lb_step = lower_bound(step_work, step_max, topology, cost.fixed, micro_batches=micro_batches)
    total_slots = None if micro_batches is None else int(np.sum(micro_batches))
    lb_epoch = (
        float(lower_bound(np.sum(step_work), np.max(step_max), topology, cost.fixed, steps, total_slots))
        if steps
        else 0.0
    )
    capacity_used = steps * topology.capacity
    total_t = float(t_step.sum())
    speeds = {} if topology.rank_speeds is None else {"rank_speeds": list(topology.rank_speeds)}
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
        **speeds,  # uneven ranks only: the speeds the times and bounds were divided by
    }
