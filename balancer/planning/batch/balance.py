"""Fixed batches (post-training): balance one given batch (RL rollouts, preference pairs) over its optimizer steps
(PPO mini-batches), DP ranks and micro-batches, with document groups kept together.

`balance_batch` builds on the planner's pieces: `planning_units` cuts documents, `pack_step` packs each step, and
dynamic CP regroups the ranks of a static plan exactly as `balancer.plan` does. The moves:

1. *Mini-batches.* Groups (a group is one document when `groups` is None) go to the `mini_batches` steps largest
   cost first, each to the step with the least work so far (LPT), so every step holds about 1/k of the work and the
   heaviest documents are spread over the steps.
2. *Micro-batch count.* `None`: `topology.micro_batches`; an int: that; `"auto"`: the fewest count M >=
   `topology.micro_batches`, the same for every DP rank and step, for which every step packs with each micro-batch
   within `max_tokens * cp` tokens.
3. *Packing.* Without rank rules, `pack_step` places the step's units (`keep="micro_batch"`: a group merged into one
   unit) straight into the `dp * M` micro-batches. With `keep="rank"` groups or `equal_counts`, the groups first go
   to the `mini_batches * dp` (step, rank) bins in one assignment (`pack_step` on one micro-batch per bin, or with
   `equal_counts` a count-constrained LPT; then a move/swap search from both ends, and with few groups per bin the
   best of seeded restarts), bins of like load share a step, and each rank's documents go to its M micro-batches
   (`pack_step` on one rank). Step 1 is then skipped (the bins are the mini-batches).
   Whatever `pack_step` leaves unplaced (it would move it to a later step; a fixed batch has none) goes where it
   raises its rank's 1F1B time least.
   A small step (under 2,048 items) without rank rules at pp = 1 is then refined by pair repartition
   (`repartition.py`): the slowest rank's and another rank's items split anew by meet in the middle, or one long
   item traded for short ones of as many tokens, bounded.
4. *Pipeline order.* With `pp > 1` each rank's micro-batches are ordered small at both ends, large in the middle,
   which shortens the 1F1B warm-up and cool-down (section-3 metrics do not depend on the order; `pipeline_times`
   simulates the schedule and measures the saving).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Optional

import numpy as np
from numpy.typing import ArrayLike

from balancer.planning.batch.dynamic import balance_dynamic
from balancer.planning.batch.pack import (
    assign_replicas,
    deal_bins,
    order_for_pipeline,
    pack_items,
    pack_ranks,
    restart_ranks,
    timed_equal_counts_start,
)
from balancer.planning.cost.model import CostModel
from balancer.planning.plans.plan import Plan
from balancer.planning.schedule import check_seed
from balancer.planning.speeds import even, planning_view, replica_speeds
from balancer.planning.topology import Topology
from balancer.planning.units import OVERFLOW_POLICIES, check_topology_and_cost, planning_units, validate_lengths

KEEP = ("rank", "micro_batch")
MAX_AUTO_MICRO_BATCHES = 4096  # "auto" gives up beyond this count (each try packs the whole batch)


def balance_batch(
    lengths: ArrayLike,
    topology: Topology,
    cost: CostModel,
    *,
    groups: Optional[ArrayLike] = None,
    keep: str = "rank",
    micro_batches: int | str | None = None,
    mini_batches: int = 1,
    equal_counts: bool = False,
    seed: int = 0,
    overflow: str = "error",
    pipeline_order: bool = True,
    micro_batch_multiple: int = 1,
) -> Plan:
    """Plan one fixed batch: document ids are positions in `lengths`, `plan.num_steps == mini_batches`.

    `groups`: one int per document; documents of a group stay on one DP rank of one step (`keep="rank"`; with
    dynamic CP: on the pool ranks of one replica of the balancing plan) or in one micro-batch
    (`keep="micro_batch"`). `micro_batches`: None (`topology.micro_batches`), a positive int, or `"auto"` (module
    docstring). `equal_counts=True`: every DP rank of a step gets the same number of documents (+-1; a window of a
    split document counts as one). `topology.tokens_per_step` is ignored (the plan's topology records the largest
    step's tokens). `overflow` as in `balancer.plan`. `pipeline_order=False` keeps the packing order of the
    micro-batches with `pp > 1`. `micro_batch_multiple`: the count is a multiple of it (virtual pipeline stages;
    with `"auto"` the fewest such count, otherwise the count must be one). The result is a deterministic function
    of the inputs and `seed`. Bad input raises one ValueError naming the argument.
    """
    started = time.perf_counter()
    lengths = validate_lengths(lengths)
    check_topology_and_cost(topology, cost)
    seed = check_seed(seed)  # a bool, a string or a negative seed reached numpy's generator (or was taken as 1)
    if planning_view(topology) is not topology:  # equal speeds: the even plan, recording the speeds
        kwargs: dict[str, Any] = dict(
            groups=groups, keep=keep, micro_batches=micro_batches, mini_batches=mini_batches, seed=seed
        )
        kwargs |= dict(equal_counts=equal_counts, overflow=overflow, pipeline_order=pipeline_order)
        placed = balance_batch(
            lengths, planning_view(topology), cost, micro_batch_multiple=micro_batch_multiple, **kwargs
        )
        placed.topology = replace(placed.topology, rank_speeds=topology.rank_speeds)
        return placed
    group_of_doc = _check_groups(groups, len(lengths))
    _check_options(keep, micro_batches, mini_batches, equal_counts, overflow)
    if not isinstance(pipeline_order, (bool, np.bool_)):
        raise ValueError(f"pipeline_order must be True or False, got {pipeline_order!r}")
    multiple = _check_multiple(micro_batch_multiple, micro_batches, topology)
    options = dict(
        has_groups=groups is not None,
        keep=keep,
        micro_batches=micro_batches,
        mini_batches=int(mini_batches),
        equal_counts=bool(equal_counts),
        seed=seed,
        overflow=overflow,
        pipeline_order=bool(pipeline_order) and topology.pp > 1 and not topology.dynamic,
        multiple=multiple,
    )
    if topology.dynamic:
        plan = balance_dynamic(lengths, topology, cost, group_of_doc, options, static=balance_static)
    else:
        plan = balance_static(lengths, topology, cost, group_of_doc, options)
    plan.plan_seconds = time.perf_counter() - started
    return plan


def _check_multiple(multiple, micro_batches, topology: Topology) -> int:
    """`micro_batch_multiple` as an int, checked against a fixed count."""
    if isinstance(multiple, bool) or not isinstance(multiple, (int, np.integer)) or multiple < 1:
        raise ValueError(f"micro_batch_multiple must be a positive integer, got {multiple!r}")
    fixed = topology.micro_batches if micro_batches is None else micro_batches
    if micro_batches != "auto" and fixed % multiple:
        raise ValueError(
            f"micro_batches={fixed} is not a multiple of micro_batch_multiple={multiple}; pass micro_batches='auto' "
            "or a multiple"
        )
    return int(multiple)


def _check_groups(groups, n: int) -> np.ndarray:
    """Dense group ids 0..G-1 per document (each document its own group when `groups` is None)."""
    if groups is None:
        return np.arange(n, dtype=np.int64)
    arr = np.asarray(groups)
    if arr.ndim != 1 or len(arr) != n:
        raise ValueError(f"groups must hold one group id per document: got shape {arr.shape}, lengths has {n}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"groups must hold integer group ids, got dtype {arr.dtype}")
    return np.unique(arr, return_inverse=True)[1].astype(np.int64).reshape(-1)


def _check_options(keep, micro_batches, mini_batches, equal_counts, overflow) -> None:
    if keep not in KEEP:
        raise ValueError(f"keep must be one of {KEEP}, got {keep!r}")
    ok_int = not isinstance(micro_batches, bool) and isinstance(micro_batches, (int, np.integer))
    if not (micro_batches is None or micro_batches == "auto" or (ok_int and micro_batches >= 1)):
        raise ValueError(f"micro_batches must be None, 'auto' or a positive integer, got {micro_batches!r}")
    if isinstance(mini_batches, bool) or not isinstance(mini_batches, (int, np.integer)) or mini_batches < 1:
        raise ValueError(f"mini_batches must be a positive integer, got {mini_batches!r}")
    if not isinstance(equal_counts, (bool, np.bool_)):
        raise ValueError(f"equal_counts must be True or False, got {equal_counts!r}")
    if overflow not in OVERFLOW_POLICIES:
        raise ValueError(f"overflow must be one of {OVERFLOW_POLICIES}, got {overflow!r}")


def balance_static(
    lengths: np.ndarray, topology: Topology, cost: CostModel, group_of_doc: np.ndarray, options: dict
) -> Plan:
    """The plan of a static-CP topology (see the module docstring); its topology carries the chosen M."""
    cap = topology.micro_batch_tokens
    u_doc, u_start, u_end = planning_units(lengths, cap, options["overflow"], topology)
    # without user groups every unit (a document or a window of a split one) is its own group
    u_group = group_of_doc[u_doc] if options["has_groups"] else np.arange(len(u_doc))
    u_tok = u_end - u_start
    u_cost = cost.cost(u_tok)
    n_groups = int(u_group.max()) + 1
    g_tok = np.bincount(u_group, weights=u_tok, minlength=n_groups).astype(np.int64)
    g_cost = np.bincount(u_group, weights=u_cost, minlength=n_groups)
    fixed_m = None if options["micro_batches"] == "auto" else (options["micro_batches"] or topology.micro_batches)
    _check_group_sizes(g_tok, u_group, u_doc, topology, options, fixed_m)
    if options["mini_batches"] > n_groups:
        what = "groups" if options["has_groups"] else "documents"
        raise ValueError(f"mini_batches={options['mini_batches']} but the batch has only {n_groups} {what}")
    rng = np.random.default_rng(options["seed"])
    g_perm = rng.permutation(n_groups)  # the seed breaks ties: every later order starts from this one
    k = options["mini_batches"]
    rank_rules = options["equal_counts"] or (options["has_groups"] and options["keep"] == "rank")
    step_cap = None if fixed_m is None else topology.dp * fixed_m * cap

    def steps_for(m: int) -> list[np.ndarray]:  # mini-batches first, each with a group per micro-batch at least
        step_of_group = split_mini_batches(g_cost, g_tok, k, g_perm, step_cap, need=topology.dp * m)
        return [_seeded(np.flatnonzero(step_of_group[u_group] == s), u_group, g_perm) for s in range(k)]

    if not rank_rules:
        most = max(int(u_tok[units].sum()) for units in steps_for(fixed_m or topology.micro_batches))
    else:
        most = -(-int(u_tok.sum()) // k)
    step = options.get("multiple", 1)

    def attempt_at(m: int, ranks: Topology = topology):
        topo = replace(ranks, micro_batches=m, tokens_per_step=None)
        if rank_rules:
            return _pack_by_ranks(g_cost, g_tok, u_group, u_cost, u_tok, g_perm, topo, options)
        step_units = steps_for(m)
        packed = [pack_items(units, u_cost, u_tok, u_group, topo) for units in step_units]
        return None if any(p is None for p in packed) else (step_units, packed)

    # where no count's speed-weighted rank assignment splits into the micro-batches (a fast rank's token room
    # filled to the last token by the largest documents, which with equal_counts it must take), the even ranks' plan
    # is taken where it does: a batch even ranks plan is never refused for the speeds (the plan records them)
    uneven_fallback = rank_rules and replica_speeds(topology) is not None
    if fixed_m is not None:
        m, attempt = fixed_m, attempt_at(fixed_m)
        if attempt is None and uneven_fallback:
            attempt = attempt_at(fixed_m, even(topology))
        if attempt is None:
            raise ValueError(
                f"the batch ({len(u_doc)} documents, {int(u_tok.sum())} tokens) does not fit {k} step(s) of "
                f"micro_batches={m} micro-batches of max_tokens*cp = {cap} tokens on each of dp={topology.dp} ranks"
                f"{' with its groups kept' if options['has_groups'] else ''}; pass micro_batches='auto', more "
                "mini_batches, or raise max_tokens"
            )
    else:
        first = -(-_first_auto_m(most, g_tok, topology, options) // step) * step
        last = min(MAX_AUTO_MICRO_BATCHES, len(u_doc) // (topology.dp * k)) // step * step
        start = _speed_start(int(u_tok.sum()), k, topology, step) if rank_rules else None
        if start is not None and options["equal_counts"]:
            start = max(start, _equal_count_start(g_cost, g_tok, u_group, g_perm, topology, k, step))
        m, attempt = fewest_fitting(first, last, step, attempt_at, start)
        if attempt is None and uneven_fallback:
            m, attempt = fewest_fitting(first, last, step, lambda m: attempt_at(m, even(topology)))
        if attempt is None:
            raise ValueError(
                f"micro_batches='auto' found no count that fits: {len(u_doc)} documents cannot fill "
                f"mini_batches*dp*M = {k}*{topology.dp}*{max(first, last + step)} micro-batches within "
                f"max_tokens*cp = {cap} tokens"
            )
    step_units, packed = attempt
    return _to_plan(lengths, topology, cost, m, u_doc, u_start, u_end, step_units, packed, options)


def fewest_fitting(
    first: int, last: int, step: int, attempt_at: Callable[[int], Optional[tuple]], start: Optional[int] = None
) -> tuple[int, Optional[tuple]]:
    """(M, attempt_at(M)) for the fewest M in first, first + step, ..., last whose attempt is not None, found by
    doubling strides from `start` (default `first`; a multiple of `step`) upwards while the attempts miss, or
    downwards while they fit, and then halving back between the last miss and the first fit (the packers fit at
    every count above one that fits, so this is the linear scan's answer in O(log) attempts, where the linear scan
    took one attempt per count: seventy at 16K rollouts on uneven ranks); (last + step, None) when none fits. A
    `start` near the answer saves the attempts between `first` and it."""
    start = first if start is None else max(first, min(start, last))
    miss, fit = first - step, None  # counts below `first` do not fit
    if start > first:
        trial = attempt_at(start)
        miss, fit = (start, None) if trial is None else (miss, (start, trial))
    if fit is None:  # upwards from the last miss
        m, stride = miss + step, step
        while m <= last:
            trial = attempt_at(m)
            if trial is not None:
                fit = (m, trial)
                break
            miss, m, stride = m, min(m + stride, last) if m < last else last + step, stride * 2
        else:
            return last + step, None
    else:  # downwards from the fit until a miss
        stride = step
        while fit[0] - stride > miss:
            trial = attempt_at(fit[0] - stride)
            if trial is None:
                miss = fit[0] - stride
                break
            fit, stride = (fit[0] - stride, trial), stride * 2
    m, attempt = fit
    while m - miss > step:  # fits at m, missed at `miss`: halve the gap (on multiples of step)
        mid = miss + (m - miss) // (2 * step) * step
        trial = attempt_at(mid)
        if trial is None:
            miss = mid
        else:
            m, attempt = mid, trial
    return m, attempt


def _pack_by_ranks(g_cost, g_tok, u_group, u_cost, u_tok, g_perm, topology: Topology, options):
    """Rank rules: the groups go to `mini_batches * dp` (step, rank) bins at once (one balanced assignment, so
    every step's ranks are even, not only every step's work), the bins are dealt to the steps (`_deal_bins`), and
    each rank's documents are packed into its micro-batches. Returns (units per step, micro-batch per unit) or None.

    `equal_counts` asks for equal counts only among the ranks of one step: when the joint assignment cannot make
    all `mini_batches * dp` bins equal, the mini-batches are split first and each step's groups assigned alone."""
    k, dp = options["mini_batches"], topology.dp
    g_count = np.bincount(u_group, minlength=len(g_cost))
    try:
        speeds = replica_speeds(topology)  # (step, rank) bin s * dp + r runs at rank r's speed
        bin_ranks = replace(topology, dp=dp * k, rank_speeds=None if speeds is None else tuple(np.tile(speeds, k)))
        g_bin = _assign(np.arange(len(g_cost)), g_cost, g_tok, g_count, g_perm, bin_ranks, options)
        if g_bin is None:
            return None
        heaviest = np.zeros(len(g_cost))
        np.maximum.at(heaviest, u_group, u_cost)
        g_bin = restart_ranks(g_bin, g_cost, g_tok, g_count, _fill(g_count, options), heaviest, k, topology, options)
        bin_at = deal_bins(np.bincount(g_bin, weights=g_cost, minlength=dp * k), k, dp, speeds)
    except ValueError:
        if not options["equal_counts"] or k == 1:
            raise
        step_of = split_mini_batches(g_cost, g_tok, k, g_perm, None)
        g_bin = np.empty(len(g_cost), dtype=np.int64)
        for s in range(k):
            mine = np.flatnonzero(step_of == s)
            ranks = _assign(mine, g_cost, g_tok, g_count, g_perm, topology, options)
            if ranks is None:
                return None
            g_bin[mine] = s * dp + ranks
        bin_at = np.arange(k * dp).reshape(k, dp)
    unit_bin = g_bin[u_group]
    step_units, packed = [], []
    for s in range(k):
        rank_units = [_seeded(np.flatnonzero(unit_bin == bin_at[s, r]), u_group, g_perm) for r in range(dp)]
        bins = pack_ranks(rank_units, u_cost, u_tok, u_group, topology, options["keep"])
        if bins is None:
            return None
        step_units.append(np.concatenate(rank_units))
        packed.append(bins)
    return step_units, packed


def _assign(members, g_cost, g_tok, g_count, g_perm, ranks: Topology, options) -> np.ndarray | None:
    """Rank (of `ranks.dp`) of each group in `members` (ascending ids), the groups offered in the seeded order."""
    position = np.empty_like(g_perm)
    position[g_perm] = np.arange(len(g_perm))
    offered = members[np.argsort(position[members], kind="stable")]
    fill = _fill(g_count, options)[offered]
    rank = assign_replicas(g_cost[offered], g_tok[offered], g_count[offered], ranks, options["equal_counts"], fill)
    if rank is None:
        return None
    out = np.empty(len(members), dtype=np.int64)
    out[np.searchsorted(members, offered)] = rank
    return out


def _fill(g_count: np.ndarray, options) -> np.ndarray:
    """What of a group fills a rank's micro-batches: its documents (`keep="rank"`: they may spread) or 1."""
    return g_count if options["keep"] == "rank" or not options["has_groups"] else np.ones_like(g_count)


def _seeded(units: np.ndarray, u_group: np.ndarray, g_perm: np.ndarray) -> np.ndarray:
    """Units in the seeded group order (a group's units together, in document order)."""
    rank = np.empty_like(g_perm)
    rank[g_perm] = np.arange(len(g_perm))
    return units[np.argsort(rank[u_group[units]], kind="stable")]


def _check_group_sizes(g_tok, u_group, u_doc, topology: Topology, options, fixed_m) -> None:
    """A group must fit where it is kept: one micro-batch (`keep="micro_batch"`) or one rank's M micro-batches."""
    if not options["has_groups"]:
        return
    cap = topology.micro_batch_tokens
    if options["keep"] == "micro_batch":
        limit, where = cap, f"one micro-batch holds (keep='micro_batch'): max_tokens*cp = {cap}"
    elif fixed_m is not None:
        limit = fixed_m * cap
        where = f"one DP rank holds in a step: micro_batches*max_tokens*cp = {fixed_m}*{cap} = {limit}"
    else:
        return
    over = g_tok > limit
    if over.any():
        g = int(np.argmax(np.where(over, g_tok, -1)))
        docs = np.unique(u_doc[u_group == g]).tolist()
        shown = ", ".join(map(str, docs[:8])) + (", ..." if len(docs) > 8 else "")
        raise ValueError(
            f"groups: the group of documents [{shown}] has {int(g_tok[g])} tokens, more than {where} "
            f"({int(over.sum())} groups are over); raise max_tokens or cp"
            + (", or pass micro_batches='auto'" if options["keep"] == "rank" else "")
        )


def split_mini_batches(
    g_cost: np.ndarray, g_tok: np.ndarray, k: int, g_perm: np.ndarray, step_cap: int | None, need: int = 0
) -> np.ndarray:
    """The step of every group: largest cost first (ties in the seeded order `g_perm`), each to the step with the
    least work so far among those with token room (`step_cap`, None: unlimited); once the groups left are just
    enough to give every step `need` groups, only steps short of `need` take them."""
    out = np.zeros(len(g_cost), dtype=np.int64)
    if k == 1:
        if step_cap is not None and g_tok.sum() > step_cap:
            raise ValueError(
                f"the batch has {int(g_tok.sum())} tokens, more than one step holds (dp*micro_batches*max_tokens*cp"
                f" = {step_cap}); pass micro_batches='auto' or more mini_batches"
            )
        return out
    work, tokens, held = np.zeros(k), np.zeros(k, dtype=np.int64), np.zeros(k, dtype=np.int64)
    for left, g in enumerate(g_perm[np.argsort(-g_cost[g_perm], kind="stable")]):
        room = np.ones(k, dtype=bool) if step_cap is None else tokens + g_tok[g] <= step_cap
        if len(g_cost) - left <= np.maximum(need - held, 0).sum():
            room &= held < need
        if not room.any():
            raise ValueError(
                f"mini_batches={k}: the batch's {int(g_tok.sum())} tokens do not fit {k} steps of "
                f"dp*micro_batches*max_tokens*cp = {step_cap} tokens; pass micro_batches='auto' or more mini_batches"
            )
        s = int(np.argmin(np.where(room, work, np.inf)))
        out[g] = s
        work[s] += g_cost[g]
        tokens[s] += g_tok[g]
        held[s] += 1
    return out


def _speed_start(tokens: int, k: int, topology: Topology, step: int) -> Optional[int]:
    """Where "auto" starts looking with rank rules on uneven ranks: the count whose micro-batches hold the fastest
    rank's speed share of a step's tokens (its rank keeps that share's documents, so fewer rarely fit). None on
    even ranks."""
    speeds = replica_speeds(topology)
    if speeds is None:
        return None
    share = tokens / k * float(speeds.max()) / float(speeds.sum())
    return -(-int(np.ceil(share / topology.micro_batch_tokens)) // step) * step


def _equal_count_start(g_cost, g_tok, u_group, g_perm, topology: Topology, k: int, step: int) -> int:
    """Where "auto" starts looking with `equal_counts` on uneven ranks: where the joint (step, rank) assignment is
    made without its token cap binding, an estimate of the count whose micro-batches hold its fullest rank
    (`timed_equal_counts_start`; fewer rarely fit); 0 where that assignment is not the one made."""
    speeds = replica_speeds(topology)
    assert speeds is not None
    count = np.bincount(u_group, minlength=len(g_cost))
    cap = topology.micro_batch_tokens
    start = timed_equal_counts_start(g_cost[g_perm], g_tok[g_perm], count[g_perm], np.tile(speeds, k), cap)
    return 0 if start is None else -(-start // step) * step


def _first_auto_m(most: int, g_tok, topology: Topology, options) -> int:
    """The smallest M worth trying: the largest step's tokens (`most`) fit `dp * M` micro-batches, and with
    `keep="rank"` groups the largest group fits one rank's M micro-batches."""
    cap = topology.micro_batch_tokens
    m = max(topology.micro_batches, -(-most // (topology.dp * cap)))
    if options["has_groups"] and options["keep"] == "rank":
        m = max(m, -(-int(g_tok.max()) // cap))
    return m


def _to_plan(lengths, topology, cost, m, u_doc, u_start, u_end, step_units, packed, options) -> Plan:
    """Assemble the Plan: per step, micro-batches in rank order (pipeline-ordered with pp > 1), whole documents
    first inside each, then spans, each part in document order."""
    topo = replace(topology, micro_batches=m, tokens_per_step=None)
    dp, nb = topo.dp, topo.bins_per_step
    u_cost = cost.cost(u_end - u_start)
    whole = (u_start == 0) & (u_end == lengths[u_doc])
    order, sizes, step_tokens = [], [], []
    for units, unit_bin in zip(step_units, packed):
        if options["pipeline_order"]:
            bin_cost = np.bincount(unit_bin, weights=u_cost[units], minlength=nb).reshape(dp, m)
            position = np.concatenate([r * m + np.argsort(order_for_pipeline(bin_cost[r])) for r in range(dp)])
            unit_bin = position[unit_bin]
        key = np.lexsort((u_start[units], u_doc[units], ~whole[units], unit_bin))
        order.append(units[key])
        sizes.append(np.bincount(unit_bin, minlength=nb))
        step_tokens.append(int((u_end - u_start)[units].sum()))
    final = replace(topo, tokens_per_step=min(max(step_tokens), topo.capacity))
    unit = np.concatenate(order)
    return Plan(
        lengths,
        final,
        cost,
        u_doc[unit],
        u_start[unit],
        u_end[unit],
        np.concatenate([[0], np.cumsum(np.concatenate(sizes))]),
        seed=options["seed"],
    )
