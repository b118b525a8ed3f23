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
   predictions of balancer.planning.cost.predict (a larger group pays more K/V traffic), so cuts pay off and short
   documents move to small groups whenever that is faster.

Uneven ranks (`rank_speeds`, one per pool rank): a group runs at its slowest member's speed, so the balancing plan's
replicas get their groups' speeds and every cut compares group times divided by the speed of the ranks they run on.

Every rank is busy in every slot (every group holds a micro-batch), every token is placed once, and the result
is a deterministic function of (lengths, topology, cost, seed).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import numpy as np

from balancer.planning.cost.model import CostModel
from balancer.planning.cost.predict import micro_batch_times
from balancer.planning.dynamic.cuts import Cuts, cut_epoch
from balancer.planning.dynamic.group_times import zigzag_sums
from balancer.planning.metrics import dynamic_step_times, one_f_one_b
from balancer.planning.plans.plan import Plan
from balancer.planning.speeds import block_speeds, group_speeds, pool_speeds
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
    steps = max(1.0, float(unit_tokens.sum()) / topology.step_tokens)
    share = float(unit_cost.sum()) / steps / pool * (1 + (pp - 1) / m)
    no_stall = sizes[pp * float(unit_cost.max()) / sizes <= STALL_SHARE * share]
    if not communication:
        size = max(size, int(no_stall.min()) if len(no_stall) else int(sizes.max()))
    holds = sizes[sizes * topology.max_tokens >= unit_tokens.max()]
    return max(size, int(holds.min()) if len(holds) else int(sizes.max()))


def largest_group_topology(topology: Topology, size: int | None = None) -> Topology:
    """The static topology of step 1: the pool as `dp * cp / C` replicas of CP size C (default max(cp_sizes)), each
    at its slowest rank's speed when `rank_speeds` is set."""
    size = topology.largest_group if size is None else size
    speeds = pool_speeds(topology)
    return Topology(
        dp=topology.pool_size // size,
        cp=size,
        pp=topology.pp,
        micro_batches=topology.micro_batches,
        max_tokens=topology.max_tokens,
        tokens_per_step=topology.tokens_per_step,
        rank_speeds=None if speeds is None else tuple(block_speeds(speeds, size).tolist()),
    )


def plan_dynamic(
    lengths: np.ndarray,
    topology: Topology,
    cost: CostModel,
    seed: int,
    overflow: str,
    progress: bool,
    static_plan: Callable[..., Plan],
    num_steps: int | None = None,
) -> Plan:
    """The dynamic-CP plan of an epoch (see the module docstring). With a communication-aware cost model two
    balancing sizes are candidates (the compute rule's and the static CP size, where larger groups pay no extra
    K/V traffic): both plan a sample of the epoch (`_pick_on_sample`) and the size whose sample plan has the
    smaller predicted time (`Plan.predict`'s `step_time_total`, assembled from the group times the cuts computed)
    plans the epoch. `static_plan` is the static planner of step 1 (`balancer.planning.planner.plan`, which calls
    this module and passes itself in). `num_steps`: exactly that many steps (the static planner's `num_steps`)."""
    started = time.perf_counter()
    check_fits(lengths, topology, overflow)
    unit_tokens = np.minimum(lengths, topology.largest_group * topology.max_tokens)
    unit_cost = cost.cost(unit_tokens)
    sizes = {base_group_size(unit_cost, unit_tokens, topology)}
    if cost.has_comm:
        sizes.add(base_group_size(unit_cost, unit_tokens, topology, communication=True))
    chosen = sorted(sizes)
    if len(chosen) > 1:
        chosen = _pick_on_sample(lengths, topology, cost, chosen, seed, overflow, static_plan)
    best: Plan | None = None
    best_time = np.inf
    for size in sorted(chosen):
        candidate, time_taken = _plan_on(
            lengths, topology, cost, size, seed, overflow, progress, static_plan, num_steps=num_steps
        )
        if time_taken < best_time or best is None:
            best, best_time = candidate, time_taken
    assert best is not None, "one plan per chosen size, and at least one size"
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
    if lengths.sum() < 4 * SAMPLE_STEPS * topology.step_tokens:  # a short epoch: a sample would not tell
        return sizes
    budget = SAMPLE_STEPS * topology.step_tokens
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
    num_steps: int | None = None,
) -> tuple[Plan, float]:
    """Steps 1 and 2 of the module docstring for balancing size `size`; returns the plan and, with a
    communication-aware cost model, its predicted step time total (`Plan.predict`), else 0."""
    virtual = largest_group_topology(topology, size)
    base = static_plan(lengths, virtual, cost, seed=seed, overflow=overflow, progress=progress, num_steps=num_steps)
    if base.filler_rows:
        raise ValueError("filler rows are not planned with dynamic CP (cp_sizes): plan without filler_rows")
    order, group_start, group_size, sizes, slot_ptr, group_times = _split_all(base, virtual, topology, cost)
    predicted = 0.0
    if cost.has_comm:  # the slot model over the layout-aware group times, as Plan.predict assembles them
        work = group_times * group_size  # the cuts' times are divided by the group's speed; the slot model divides
        if pool_speeds(topology, planning=True) is not None:
            work = work * group_speeds(pool_speeds(topology), group_start, group_size)
        predicted = float(dynamic_step_times(work, group_start, group_size, slot_ptr, topology).sum())
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
        last_micro_batches=base.last_micro_batches,
    )
    return plan, predicted


def _split_all(base: Plan, virtual: Topology, topology: Topology, cost: CostModel):
    """`split_groups` of the whole balancing plan; a short last step (M' < M slots) is cut on its own, with M' as
    the micro-batch count, and appended."""
    m_last = base.last_micro_batches
    if m_last == topology.micro_batches:
        return split_groups(base, virtual, topology, cost)
    first = (base.num_steps - 1) * virtual.bins_per_step  # the short step's first micro-batch
    parts = []
    for lo, hi, t_v, t in (
        (0, first, virtual, topology),
        (first, len(base.mb_ptr) - 1, replace_m(virtual, m_last), replace_m(topology, m_last)),
    ):
        if hi > lo:
            a, b = int(base.mb_ptr[lo]), int(base.mb_ptr[hi])
            part = Plan(
                base.lengths, t_v, cost, base.doc[a:b], base.start[a:b], base.end[a:b], base.mb_ptr[lo : hi + 1] - a,
                dropped_tokens=0,
            )  # fmt: skip
            parts.append((a, split_groups(part, t_v, t, cost)))
    if len(parts) == 1:
        return parts[0][1]
    (_, full), (offset, short) = parts
    return (
        np.concatenate([full[0], short[0] + offset]),
        *(np.concatenate([full[i], short[i]]) for i in (1, 2, 3)),
        np.concatenate([full[4], short[4][1:] + full[4][-1]]),
        np.concatenate([full[5], short[5]]),
    )


def replace_m(topology: Topology, m: int) -> Topology:
    """`topology` with `m` micro-batches per step (the budget kept within the smaller capacity)."""
    small = dataclasses.replace(topology, micro_batches=m, tokens_per_step=None)
    return dataclasses.replace(small, tokens_per_step=min(topology.step_tokens, small.capacity))


def split_groups(base: Plan, virtual: Topology, topology: Topology, cost: CostModel) -> tuple:
    """Cut every micro-batch of the largest-group plan into aligned smaller groups where that costs (almost) no time.

    Returns the entry order of the new plan, each group's first rank, size and entry count, the slot pointer and
    each group's time (per rank; layout-aware with a communication-aware cost model).

    After a cut, a slot takes its slowest part's time (the other parts' ranks wait for their next partners), so a
    large group's ranks finish by at most `(P-1) * max_k x_k + sum_k x_k` with x_k the slots' slowest parts: a slot
    may be cut into parts as slow as the budget that keeps this bound within the step's time plus SPLIT_SLACK (a
    replica below the step's time has room to spare; the slowest one only SPLIT_SLACK). balancer.planning.dynamic.cuts
    deals and decides every micro-batch of the epoch at once.
    """
    large, m, replicas = virtual.cp, topology.micro_batches, virtual.dp
    tokens = base.end - base.start
    entry_cost = cost.cost(tokens)
    group_times = _group_times(cost, entry_cost, tokens)
    if not cost.has_comm:
        slot_time = base.micro_batch_costs().ravel() / large  # fixed included
    else:  # every micro-batch at once
        n_mb = len(base.mb_ptr) - 1
        slot_time = group_times(np.arange(len(tokens)), np.repeat(np.arange(n_mb), np.diff(base.mb_ptr)), n_mb, large)
    shape = (base.num_steps, replicas, m)
    speeds = pool_speeds(topology, planning=True)
    if speeds is not None:  # a micro-batch of the balancing plan runs at its replica's (slowest rank's) speed
        slot_time = slot_time / np.repeat(np.tile(block_speeds(speeds, large), base.num_steps), m)
    per = slot_time.reshape(shape)
    limit = one_f_one_b(per.max(axis=2), per.sum(axis=2), topology.pp).max(axis=1) * (1 + SPLIT_SLACK)
    assert topology.cp_sizes is not None, "split_groups plans dynamic CP: cp_sizes is set"
    cutter = Cuts(entry_cost, tokens, _smaller_sizes(topology.cp_sizes), topology.max_tokens, group_times, speeds)
    return cut_epoch(cutter, base.mb_ptr, slot_time, limit, large, shape, topology.pp)


def _group_times(cost: CostModel, entry_cost: np.ndarray, entry_tokens: np.ndarray):
    """`times(entries, group, n_groups, size)`: every group's time on `size` ranks, `(sum cost + fixed) / size`, or
    with a communication-aware cost model the slowest rank's predicted time under the zigzag layout and ring
    attention (balancer.planning.cost.predict; on one rank the prediction is exactly the former)."""

    def times(entries: np.ndarray, group: np.ndarray, n_groups: int, size: int) -> np.ndarray:
        if not cost.has_comm or size == 1:
            return (np.bincount(group, weights=entry_cost[entries], minlength=n_groups) + cost.fixed) / size
        fast = zigzag_sums(cost, size)
        if fast is not None:
            return fast(entry_tokens[entries], group, n_groups)
        order = np.argsort(group, kind="stable")
        ptr = np.searchsorted(group[order], np.arange(n_groups + 1))
        return micro_batch_times(cost, entry_tokens[entries[order]], ptr, size)

    return times


def _smaller_sizes(sizes: tuple[int, ...]) -> dict[int, int]:
    """For every size, the largest smaller size in `sizes` that divides it (absent: cannot be cut)."""
    out = {}
    for size in sizes:
        divisors = [s for s in sizes if s < size and size % s == 0]
        if divisors:
            out[size] = max(divisors)
    return out
