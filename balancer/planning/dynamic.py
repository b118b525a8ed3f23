"""Dynamic CP planning: in every micro-batch slot the pool of `dp * cp` ranks is cut into CP groups of the sizes in
`cp_sizes`, giant documents on large groups, short ones on groups of one rank (no communication).

1. *Balance on the largest groups.* The epoch is planned by the static planner for the pool cut into groups of the
   largest size C = max(cp_sizes) (`dp * cp / C` replicas of CP size C): the same steps, the same 1F1B balancing,
   and with it the dynamic bound `P * max_d cost(d) / C` instead of `P * max_d cost(d) / cp`.
2. *Split what needs no large group.* Each group's micro-batch is then cut, recursively, into the next smaller
   size that divides it (an aligned sub-partition, so `start % size == 0` holds): its documents are dealt largest
   first to the least-loaded part, and the cut is kept only when every part is non-empty, within its token cap
   and no part's time `(cost + fixed) / size` exceeds the group's by more than SPLIT_SLACK. A document heavier than
   its share keeps the large group; a micro-batch of short documents ends on groups of one rank.

Every rank is busy in every slot (every group holds a micro-batch), every token is placed once, and the result
is a deterministic function of (lengths, topology, cost, seed).
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass

import numpy as np

from .cost import CostModel
from .plan import Plan
from .topology import Topology

SPLIT_SLACK = 1e-3  # a group is cut into smaller ones only if no part then runs longer than this share over it


def check_fits(lengths: np.ndarray, topology: Topology, overflow: str) -> None:
    """With overflow='error', every document must fit the largest CP group: a ValueError naming the document."""
    cap = topology.max_tokens * topology.largest_group
    if overflow == "error" and lengths.max() > cap:
        i = int(np.argmax(lengths))
        raise ValueError(
            f"document {i} has {int(lengths[i])} tokens, more than the largest CP group holds: max(cp_sizes)*"
            f"max_tokens = {topology.largest_group}*{topology.max_tokens} = {cap}; add a larger size to cp_sizes "
            f"(up to dp*cp = {topology.pool_size}), raise max_tokens, or pass overflow='split' or 'truncate'"
        )


def largest_group_topology(topology: Topology) -> Topology:
    """The static topology of step 1: the pool as `dp * cp / C` replicas of CP size C = max(cp_sizes)."""
    size = topology.largest_group
    return Topology(
        dp=topology.pool_size // size,
        cp=size,
        pp=topology.pp,
        micro_batches=topology.micro_batches,
        max_tokens=topology.max_tokens,
        tokens_per_step=topology.tokens_per_step,
    )


def plan_dynamic(
    lengths: np.ndarray, topology: Topology, cost: CostModel, seed: int, overflow: str, progress: bool
) -> Plan:
    """The dynamic-CP plan of an epoch (see the module docstring)."""
    from .planner import plan as static_plan

    started = time.perf_counter()
    check_fits(lengths, topology, overflow)
    base = static_plan(lengths, largest_group_topology(topology), cost, seed=seed, overflow=overflow, progress=progress)
    order, group_start, group_size, sizes, slot_ptr = _split_groups(base, topology, cost)
    return Plan(
        base.lengths,
        topology,
        cost,
        base.doc[order],
        base.start[order],
        base.end[order],
        np.concatenate([[0], np.cumsum(sizes)]),
        seed=seed,
        natural_step=base.natural_step,
        plan_seconds=time.perf_counter() - started,
        dropped_tokens=base.dropped_tokens,
        groups=(group_start, group_size, slot_ptr),
    )


@dataclass
class _Cutter:
    """What the recursive cut needs: per-entry cost and tokens, the cut sizes, the token cap and fixed cost."""

    entry_cost: np.ndarray
    entry_tokens: np.ndarray
    smaller: dict[int, int]  # size -> the largest smaller size in cp_sizes dividing it
    max_tokens: int
    fixed: float

    def split(self, entries: np.ndarray, start: int, size: int, budget: float) -> list[tuple[int, int, np.ndarray]]:
        """Groups `(start, size, entries)` covering ranks `[start, start + size)`, cut recursively while every
        part stays within `budget` time (module docstring)."""
        part_size = self.smaller.get(size)
        if part_size is None or len(entries) < size // part_size:
            return [(start, size, entries)]
        parts = size // part_size
        part_of = _deal_largest_first(self.entry_cost[entries], parts)
        load = np.bincount(part_of, weights=self.entry_cost[entries], minlength=parts)
        tokens = np.bincount(part_of, weights=self.entry_tokens[entries], minlength=parts)
        used = np.bincount(part_of, minlength=parts)
        too_slow = (load + self.fixed) / part_size > budget
        if used.min() == 0 or tokens.max() > part_size * self.max_tokens or too_slow.any():
            return [(start, size, entries)]
        out = []
        for p in range(parts):
            members = entries[part_of == p]  # keeps the micro-batch's order (whole documents, then spans)
            out += self.split(members, start + p * part_size, part_size, budget)
        return out


def _split_groups(base: Plan, topology: Topology, cost: CostModel):
    """Cut every micro-batch of the largest-group plan into aligned smaller groups where that costs no time.

    Returns the entry order of the new plan, each group's first rank, size and entry count, and the slot pointer.
    """
    large, m = topology.largest_group, topology.micro_batches
    replicas = topology.pool_size // large
    entry_cost = cost.cost(base.end - base.start)
    cutter = _Cutter(
        entry_cost, base.end - base.start, _smaller_sizes(topology.cp_sizes), topology.max_tokens, cost.fixed
    )
    order, group_start, group_size, counts, slot_ptr = [], [], [], [], [0]
    for step in range(base.num_steps):
        for slot in range(m):
            for replica in range(replicas):
                k = (step * replicas + replica) * m + slot
                entries = np.arange(base.mb_ptr[k], base.mb_ptr[k + 1])
                budget = (entry_cost[entries].sum() + cost.fixed) / large * (1 + SPLIT_SLACK)
                for start, size, members in cutter.split(entries, replica * large, large, budget):
                    order.append(members)
                    group_start.append(start)
                    group_size.append(size)
                    counts.append(len(members))
            slot_ptr.append(len(group_start))
    as_array = [np.asarray(a, dtype=np.int64) for a in (group_start, group_size, counts, slot_ptr)]
    return (np.concatenate(order) if order else np.zeros(0, dtype=np.int64), *as_array)


def _smaller_sizes(sizes: tuple[int, ...]) -> dict[int, int]:
    """For every size, the largest smaller size in `sizes` that divides it (absent: cannot be cut)."""
    out = {}
    for size in sizes:
        divisors = [s for s in sizes if s < size and size % s == 0]
        if divisors:
            out[size] = max(divisors)
    return out


def _deal_largest_first(costs: np.ndarray, parts: int, exact: int = 32) -> np.ndarray:
    """Items to `parts` parts of near-equal cost: the `exact * parts` largest by LPT (largest first, each to the
    least-loaded part, ties to the lowest), the rest, in their order, cut into runs that fill each part's remaining
    room (error at most one small item per part; keeps the loop short for micro-batches of many documents)."""
    part_of = np.empty(len(costs), dtype=np.int64)
    order = np.argsort(-costs, kind="stable")
    heap = [(0.0, p) for p in range(parts)]
    for i in order[: exact * parts]:
        load, p = heapq.heappop(heap)
        part_of[i] = p
        heapq.heappush(heap, (load + float(costs[i]), p))
    rest = np.sort(order[exact * parts :])
    if len(rest):
        load = np.zeros(parts)
        for value, p in heap:
            load[p] = value
        room = np.maximum((load.sum() + costs[rest].sum()) / parts - load, 0.0)
        before = np.cumsum(costs[rest]) - costs[rest] / 2  # an item goes where its midpoint falls
        part_of[rest] = np.minimum(np.searchsorted(np.cumsum(room), before, side="right"), parts - 1)
    return part_of
