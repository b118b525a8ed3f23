"""Dynamic CP planning: in every micro-batch slot the pool of `dp * cp` ranks is cut into CP groups of the sizes in
`cp_sizes`, giant documents on large groups, short ones on groups of one rank (no communication).

1. *Balance on large groups.* The epoch is planned by the static planner for the pool cut into groups of one size
   C (`dp * cp / C` replicas of CP size C; `base_group_size` picks C): the same steps, the same 1F1B balancing,
   and with it the bound `P * max_d cost(d) / C` instead of `P * max_d cost(d) / cp`.
2. *Cut what needs no large group.* Each group's micro-batch is then cut into aligned smaller groups (so
   `start % size == 0` holds): straight into the smallest size, else into the next smaller one, recursively; its
   documents are dealt largest first to the least-loaded part, and a cut is kept only when every part is
   non-empty, within its token cap, and the group's ranks still finish within the step's time plus SPLIT_SLACK.
   A document heavier than its share keeps a large group; a micro-batch of short documents ends on groups of one
   rank. With a communication-aware cost model (`CostModel.has_comm`) the times compared are the layout-aware
   predictions of balancer.planning.predict (a larger group pays more K/V traffic), so cuts pay off and short
   documents move to small groups whenever that is faster.

Every rank is busy in every slot (every group holds a micro-batch), every token is placed once, and the result
is a deterministic function of (lengths, topology, cost, seed).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from balancer.planning.cost import CostModel
from balancer.planning.metrics import dynamic_step_times, one_f_one_b
from balancer.planning.plans import Plan
from balancer.planning.topology import Topology

MIN_BINS = 16  # the balancing plan keeps at least this many micro-batches per step (when no document stalls)
STALL_SHARE = 0.5  # ... and a group size on which P * cost(d) / C is at most this share of a rank's step share
SAMPLE_STEPS = 24  # with a communication-aware cost model the balancing size is chosen on this many steps' worth
SPLIT_SLACK = 5e-3  # cutting groups may make a step at most this much slower than the largest-group plan


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


def base_group_size(
    unit_cost: np.ndarray, unit_tokens: np.ndarray, topology: Topology, communication: bool = False
) -> int:
    """The CP size C of the balancing plan (step 1).

    The largest size balances best (one replica pools every document) but leaves few micro-batches per step to
    pack (slow: the packer deals units in rounds of one per micro-batch); so C is the largest size that keeps at
    least MIN_BINS micro-batches per step, raised to the smallest size on which no document stalls its step
    (`P * cost(d) / C` within STALL_SHARE of a rank's share of a step) and to what the longest unit needs. With a
    `communication`-aware cost model: the static CP size (or what the longest unit needs; large groups are not free).
    """
    sizes = np.asarray(topology.cp_sizes)
    pool, m, pp = topology.pool_size, topology.micro_batches, topology.pp
    many_bins = sizes[(pool // sizes) * m >= MIN_BINS]
    size = int(many_bins.max()) if len(many_bins) else int(sizes.min())
    if communication:  # large groups cost K/V traffic: start from the static CP size, grow only to fit
        size = int(sizes[sizes >= topology.cp].min()) if np.any(sizes >= topology.cp) else int(sizes.max())
    steps = max(1.0, float(unit_tokens.sum()) / topology.tokens_per_step)
    share = float(unit_cost.sum()) / steps / pool * (1 + (pp - 1) / m)
    no_stall = sizes[pp * float(unit_cost.max()) / sizes <= STALL_SHARE * share]
    if not communication:
        size = max(size, int(no_stall.min()) if len(no_stall) else int(sizes.max()))
    holds = sizes[sizes * topology.max_tokens >= unit_tokens.max()]
    return max(size, int(holds.min()) if len(holds) else int(sizes.max()))


def largest_group_topology(topology: Topology, size: int | None = None) -> Topology:
    """The static topology of step 1: the pool as `dp * cp / C` replicas of CP size C (default max(cp_sizes))."""
    size = topology.largest_group if size is None else size
    return Topology(
        dp=topology.pool_size // size,
        cp=size,
        pp=topology.pp,
        micro_batches=topology.micro_batches,
        max_tokens=topology.max_tokens,
        tokens_per_step=topology.tokens_per_step,
    )


def plan_dynamic(
    lengths: np.ndarray,
    topology: Topology,
    cost: CostModel,
    seed: int,
    overflow: str,
    progress: bool,
    static_plan: Callable[..., Plan],
) -> Plan:
    """The dynamic-CP plan of an epoch (see the module docstring). With a communication-aware cost model two
    balancing sizes are candidates (the compute rule's and the static CP size, where larger groups pay no extra
    K/V traffic): both plan a sample of the epoch (`_pick_on_sample`) and the size whose sample plan has the
    smaller predicted time (`Plan.predict`'s `step_time_total`, assembled from the group times the cuts computed)
    plans the epoch. `static_plan` is the static planner of step 1 (`balancer.planning.planner.plan`, which calls
    this module and passes itself in)."""
    started = time.perf_counter()
    check_fits(lengths, topology, overflow)
    unit_tokens = np.minimum(lengths, topology.largest_group * topology.max_tokens)
    unit_cost = cost.cost(unit_tokens)
    sizes = {base_group_size(unit_cost, unit_tokens, topology)}
    if cost.has_comm:
        sizes.add(base_group_size(unit_cost, unit_tokens, topology, communication=True))
    if len(sizes) > 1:
        sizes = _pick_on_sample(lengths, topology, cost, sorted(sizes), seed, overflow, static_plan)
    best, best_time = None, np.inf
    for size in sorted(sizes):
        candidate, time_taken = _plan_on(lengths, topology, cost, size, seed, overflow, progress, static_plan)
        if time_taken < best_time or best is None:
            best, best_time = candidate, time_taken
    best.plan_seconds = time.perf_counter() - started
    return best


def _pick_on_sample(
    lengths: np.ndarray,
    topology: Topology,
    cost: CostModel,
    sizes: list[int],
    seed: int,
    overflow: str,
    static_plan: Callable[..., Plan],
) -> list[int]:
    """The balancing size whose plan of a sample of the epoch (SAMPLE_STEPS steps' worth of documents, drawn by
    `seed`) has the smaller predicted time; all `sizes` when the epoch is shorter than four samples (or the sample
    cannot be planned). Planning both sizes in full would double the work for one comparison."""
    if lengths.sum() < 4 * SAMPLE_STEPS * topology.tokens_per_step:  # a short epoch: a sample would not tell
        return sizes
    budget = SAMPLE_STEPS * topology.tokens_per_step
    order = np.random.default_rng([seed, 3]).permutation(len(lengths))
    sample = lengths[order[: int(np.searchsorted(np.cumsum(lengths[order]), budget)) + 1]]
    try:
        times = [_plan_on(sample, topology, cost, size, seed, overflow, False, static_plan)[1] for size in sizes]
    except ValueError:
        return sizes
    return [sizes[int(np.argmin(times))]]


def _plan_on(
    lengths: np.ndarray,
    topology: Topology,
    cost: CostModel,
    size: int,
    seed: int,
    overflow: str,
    progress: bool,
    static_plan: Callable[..., Plan],
) -> tuple[Plan, float]:
    """Steps 1 and 2 of the module docstring for balancing size `size`; returns the plan and, with a
    communication-aware cost model, its predicted step time total (`Plan.predict`), else 0."""
    virtual = largest_group_topology(topology, size)
    base = static_plan(lengths, virtual, cost, seed=seed, overflow=overflow, progress=progress)
    order, group_start, group_size, sizes, slot_ptr, group_times = _split_groups(base, virtual, topology, cost)
    predicted = 0.0
    if cost.has_comm:  # the slot model over the layout-aware group times, as Plan.predict assembles them
        predicted = float(
            dynamic_step_times(group_times * group_size, group_start, group_size, slot_ptr, topology).sum()
        )
    plan = Plan(
        base.lengths,
        topology,
        cost,
        base.doc[order],
        base.start[order],
        base.end[order],
        np.concatenate([[0], np.cumsum(sizes)]),
        seed=seed,
        natural_step=base.natural_step,
        dropped_tokens=base.dropped_tokens,
        groups=(group_start, group_size, slot_ptr),
    )
    return plan, predicted


@dataclass
class _Cutter:
    """What the recursive cut needs: per-entry cost and tokens, the cut sizes, the token cap and fixed cost."""

    entry_cost: np.ndarray
    entry_tokens: np.ndarray
    smaller: dict[int, int]  # size -> the largest smaller size in cp_sizes dividing it
    max_tokens: int
    fixed: float
    cost: CostModel | None = None  # a communication-aware model: group times from the layout-aware prediction

    finest: dict[int, int] = field(default_factory=dict)  # size -> the smallest size reached by cutting it
    known: dict = field(default_factory=dict)  # (size, entries) -> predicted group time (each is computed once)

    def __post_init__(self) -> None:
        for size in self.smaller:
            finest = size
            while finest in self.smaller:
                finest = self.smaller[finest]
            self.finest[size] = finest

    def group_time(self, entries: np.ndarray, size: int) -> float:
        """Time of one group's micro-batch: `(sum cost + fixed) / size`, or with a communication-aware cost model
        the slowest rank's predicted time under the zigzag layout and ring attention (balancer.planning.predict)."""
        if self.cost is None or size == 1:  # with one rank the prediction is exactly this (no layout, no traffic)
            return (float(self.entry_cost[entries].sum()) + self.fixed) / size
        from balancer.planning.predict import micro_batch_time

        key = (size, entries.tobytes())
        if key not in self.known:
            self.known[key] = micro_batch_time(self.cost, self.entry_tokens[entries], size)
        return self.known[key]

    def split(self, entries: np.ndarray, start: int, size: int, budget: float) -> list[tuple[int, int, np.ndarray]]:
        """Groups `(start, size, entries)` covering ranks `[start, start + size)`, cut while every part stays within
        `budget` time: first straight into the smallest size (one deal, the common case of short documents), else
        into the next smaller size, recursively (module docstring)."""
        whole = [(start, size, entries)]
        part_size = self.smaller.get(size)
        if part_size is None:
            return whole
        finest = self.finest[size]
        if finest < part_size:
            parts = self._deal(entries, size // finest, finest, budget)
            if parts is not None:
                return [(start + p * finest, finest, members) for p, members in enumerate(parts)]
        parts = self._deal(entries, size // part_size, part_size, budget)
        if parts is None:
            return whole
        out = []
        for p, members in enumerate(parts):
            out += self.split(members, start + p * part_size, part_size, budget)
        return out

    def _deal(self, entries: np.ndarray, parts: int, part_size: int, budget: float) -> list[np.ndarray] | None:
        """`entries` dealt into `parts` parts of `part_size` ranks (each keeping the micro-batch's order: whole
        documents, then spans), or None when a part would be empty, over its token cap or slower than `budget`."""
        if len(entries) < parts:
            return None
        costs = self.entry_cost[entries]
        compute_only = self.cost is None
        if compute_only and (costs.max() + self.fixed) / part_size > budget:  # the largest document alone is too slow
            return None
        if compute_only and (costs.sum() / parts + self.fixed) / part_size > budget:  # even a perfect deal is
            return None
        part_of = _deal_largest_first(costs, parts)
        tokens = np.bincount(part_of, weights=self.entry_tokens[entries], minlength=parts)
        used = np.bincount(part_of, minlength=parts)
        if used.min() == 0 or tokens.max() > part_size * self.max_tokens:
            return None
        members = [entries[part_of == p] for p in range(parts)]
        if any(self.group_time(part, part_size) > budget for part in members):
            return None
        return members


def _split_groups(base: Plan, virtual: Topology, topology: Topology, cost: CostModel):
    """Cut every micro-batch of the largest-group plan into aligned smaller groups where that costs (almost) no time.

    Returns the entry order of the new plan, each group's first rank, size and entry count, the slot pointer and
    each group's time (per rank; layout-aware with a communication-aware cost model).
    """
    large, m = virtual.cp, topology.micro_batches
    replicas = virtual.dp
    entry_cost = cost.cost(base.end - base.start)
    cutter = _Cutter(
        entry_cost,
        base.end - base.start,
        _smaller_sizes(topology.cp_sizes),
        topology.max_tokens,
        cost.fixed,
        cost if cost.has_comm else None,
    )
    if cutter.cost is None:
        slot_time = base.micro_batch_costs() / large  # fixed included
    else:  # every micro-batch at once; the cuts below look these up
        from balancer.planning.predict import micro_batch_times

        ptr = base.mb_ptr
        slot_time = micro_batch_times(cost, base.end - base.start, ptr, large)
        for k in range(len(ptr) - 1):
            cutter.known[(large, np.arange(ptr[k], ptr[k + 1]).tobytes())] = float(slot_time[k])
    slot_time = slot_time.reshape(base.num_steps, replicas, m)
    order, group_start, group_size, counts, slot_ptr = [], [], [], [], [0]
    for step in range(base.num_steps):
        replica_time = one_f_one_b(slot_time[step].max(axis=1), slot_time[step].sum(axis=1), topology.pp)
        limit = float(replica_time.max()) * (1 + SPLIT_SLACK)
        cuts = [_cut_replica(cutter, base, step, r, slot_time[step, r], limit, virtual) for r in range(replicas)]
        for slot in range(m):
            for replica in range(replicas):
                for start, size, members in cuts[replica][slot]:
                    order.append(members)
                    group_start.append(start)
                    group_size.append(size)
                    counts.append(len(members))
            slot_ptr.append(len(group_start))
    as_array = [np.asarray(a, dtype=np.int64) for a in (group_start, group_size, counts, slot_ptr)]
    times = np.array([cutter.group_time(members, int(z)) for members, z in zip(order, group_size)])
    return (np.concatenate(order) if order else np.zeros(0, dtype=np.int64), *as_array, times)


def _cut_replica(
    cutter: _Cutter, base: Plan, step: int, replica: int, times: np.ndarray, limit: float, topology: Topology
) -> list:
    """The cuts of one large group's micro-batches of `step`, slot by slot, such that the group's ranks still
    finish within `limit`.

    After a cut, a slot takes its slowest part's time (the other parts' ranks wait for their next partners), so
    the group's ranks finish by at most `(P-1) * max_k x_k + sum_k x_k` with x_k the slots' slowest parts: a slot
    may be cut into parts as slow as `budget` while that bound stays within `limit` (a replica below the step's
    time has room to spare; the slowest one only SPLIT_SLACK).
    """
    large, m, pp, replicas = topology.cp, topology.micro_batches, topology.pp, topology.dp
    slowest, total = float(times.max()), float(times.sum())
    out = []
    for slot in range(m):
        k = (step * replicas + replica) * m + slot
        entries = np.arange(base.mb_ptr[k], base.mb_ptr[k + 1])
        rest = total - times[slot]
        # the largest x with (P-1) * max(slowest, x) + rest + x <= limit (the 1F1B bound above, inverted)
        budget = limit - (pp - 1) * slowest - rest
        if budget > slowest:
            budget = (limit - rest) / pp
        groups = cutter.split(entries, replica * large, large, max(budget, float(times[slot])))
        taken = float(times[slot]) if len(groups) == 1 else max(cutter.group_time(g, z) for _, z, g in groups)
        if one_f_one_b(max(slowest, taken), rest + taken, pp) > limit and len(groups) > 1:
            groups, taken = [(replica * large, large, entries)], float(times[slot])  # rounding: keep it whole
        total, slowest = rest + taken, max(slowest, taken)
        out.append(groups)
    return out


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
    values = costs.tolist()
    order = sorted(range(len(values)), key=values.__getitem__, reverse=True)  # stable (ties keep their order)
    part_of = [0] * len(values)
    heap = [(0.0, p) for p in range(parts)]
    for i in order[: exact * parts]:
        load, p = heapq.heappop(heap)
        part_of[i] = p
        heapq.heappush(heap, (load + values[i], p))
    part_of = np.asarray(part_of, dtype=np.int64)
    rest = np.sort(np.asarray(order[exact * parts :], dtype=np.int64))
    if len(rest):
        load = np.zeros(parts)
        for value, p in heap:
            load[p] = value
        room = np.maximum((load.sum() + costs[rest].sum()) / parts - load, 0.0)
        before = np.cumsum(costs[rest]) - costs[rest] / 2  # an item goes where its midpoint falls
        part_of[rest] = np.minimum(np.searchsorted(np.cumsum(room), before, side="right"), parts - 1)
    return part_of
