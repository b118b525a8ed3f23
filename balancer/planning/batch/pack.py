"""Packing one step of a fixed batch (balancer.planning.batch.balance): units to DP ranks and micro-batches with the
project's `pack_step`, completed so that nothing is left for a later step, with rank rules (groups kept on one
rank, equal document counts), and the pipeline order of each rank's micro-batches. With uneven ranks
(`Topology.rank_speeds`) a rank's time is its summed cost (its 1F1B time) divided by its speed throughout."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Optional

import numpy as np

from balancer.planning.batch.large import (
    LARGE_UNITS,
    balance_swaps,
    deal_equal_counts,
    lpt_timed,
    pack_large,
    pack_replica,
    placed_tokens,
)
from balancer.planning.batch.repartition import repartition_pairs
from balancer.planning.packing.search import polish
from balancer.planning.packing.step import fill_empty, pack_step, place_rest
from balancer.planning.speeds import replica_speeds, with_speeds
from balancer.planning.topology import Topology

if TYPE_CHECKING:
    from balancer.planning.plans.plan import Plan

POLISH_ROUNDS = 500  # most rounds of binpack's move/swap search per step (it stops when a round finds nothing)
SWAP_ROUNDS = 400  # rank-level search: rounds of the best move or swap off the slowest rank
RESTARTS = 128  # rank rules with at most RESTART_ITEMS groups per rank: random starts of the rank search ...
RESTART_ITEMS = 8  # ... (coarse items balance unevenly from a single start; many small ones do not need it)


def pack_items(
    units: np.ndarray, u_cost: np.ndarray, u_tok: np.ndarray, u_group: np.ndarray, topology: Topology
) -> np.ndarray | None:
    """Micro-batch (replica * M + m) of each unit of one step, packed straight into the `dp * M` micro-batches, a
    group's units merged into one item (`keep="micro_batch"`; without groups every unit is its own group); None
    when the step does not fit `topology`."""
    _, item_of = np.unique(u_group[units], return_inverse=True)
    item_of = item_of.reshape(-1)
    item_cost = np.bincount(item_of, weights=u_cost[units])
    item_tok = np.bincount(item_of, weights=u_tok[units]).astype(np.int64)
    bins = pack_complete(item_cost, item_tok, topology)
    if bins is None:
        return None
    if len(item_cost) < LARGE_UNITS:  # a small step: its replicas' items split anew, pair by pair (bounded)
        bins = repartition_pairs(bins, item_cost, item_tok, topology, pack_replica)
    return bins[item_of]


def pack_ranks(
    rank_units: list, u_cost: np.ndarray, u_tok: np.ndarray, u_group: np.ndarray, topology: Topology, keep: str
) -> np.ndarray | None:
    """Micro-batch of each unit of one step whose units are already on their DP ranks (`rank_units[r]`), for the
    units concatenated in rank order: each rank's documents (`keep="rank"`) or merged groups (`"micro_batch"`)
    packed into its M micro-batches. None when a rank does not fit."""
    one_rank = with_speeds(topology, None, dp=1, tokens_per_step=None)  # one replica: its speed scales every time
    # a large step on uneven ranks: each rank's share by the near-linear path too (uneven shares put ranks below
    # LARGE_UNITS where even ones are above it; the exact search is quadratic in a rank's units)
    large = replica_speeds(topology) is not None and sum(len(u) for u in rank_units) >= LARGE_UNITS
    out = []
    for r, units in enumerate(rank_units):
        bins = pack_large(u_cost[units], u_tok[units], one_rank) if large and keep == "rank" else None
        if bins is None and large and keep == "rank" and len(units) >= LARGE_UNITS:
            return None  # pack_complete would ask pack_large the same again
        bins = bins if bins is not None else (
            pack_complete(u_cost[units], u_tok[units], one_rank)
            if keep == "rank"
            else pack_items(units, u_cost, u_tok, u_group, one_rank)
        )  # fmt: skip
        if bins is None:
            return None
        out.append(r * topology.micro_batches + bins)
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def pack_complete(cost: np.ndarray, tokens: np.ndarray, topology: Topology) -> np.ndarray | None:
    """`pack_step`, then every unit it left for a later step placed where it raises its replica's 1F1B time least
    and every empty micro-batch filled, then polished; None when a unit fits nowhere or a micro-batch stays empty."""
    nb = topology.bins_per_step
    if len(cost) < nb:
        return None
    if len(cost) >= LARGE_UNITS:  # near-linear (the move/swap search below is quadratic in the units)
        return pack_large(cost, tokens, topology, replica_speeds(topology))
    bins = pack_step(cost, tokens, topology)
    if np.any(bins < 0) and not place_rest(bins, cost, tokens, topology):
        return None
    fill_empty(bins, cost, nb)
    if np.bincount(bins, minlength=nb).min() == 0:
        return None
    # pack_step polishes only small steps (the planner's steps are many and large); a fixed batch is one or a
    # few steps, so every one gets the move/swap search until it stops improving
    polish(bins, cost, tokens, topology, rounds=POLISH_ROUNDS)
    return bins


def assign_replicas(
    cost: np.ndarray,
    tokens: np.ndarray,
    count: np.ndarray,
    topology: Topology,
    equal_counts: bool,
    fill: Optional[np.ndarray] = None,
) -> np.ndarray | None:
    """DP rank of every item (a group, or a unit without groups) so that the ranks' work is even, each rank within
    `M * max_tokens * cp` tokens and holding at least M of what fills micro-batches (`fill` per item: its documents
    when they may spread over micro-batches, 1 when it stays whole; default `count`); with `equal_counts`, every
    rank's document count (`count` per item) within one of every other's. None when the items do not fit."""
    fill = count if fill is None else fill
    dp, m = topology.dp, topology.micro_batches
    rank_cap = m * topology.micro_batch_tokens
    speeds = replica_speeds(topology)
    large = len(cost) >= LARGE_UNITS  # the near-linear large-batch paths
    uniform = large and _like_items(count, dp)
    if equal_counts and uniform and speeds is None:  # dealing whole items keeps the document counts within one
        rep = deal_equal_counts(cost, tokens, dp, rank_cap)
        if rep is None:
            rep = _equal_count_lpt(cost, tokens, count, dp, rank_cap)
    elif equal_counts and uniform and speeds is not None:  # uneven ranks, like items: the fastest take one more
        rep = _timed_equal_counts(cost, tokens, speeds, rank_cap)
    elif equal_counts:
        rep = _equal_count_lpt(cost, tokens, count, dp, rank_cap, speeds=speeds)
    else:
        per_rank = Topology(dp=dp, micro_batches=1, max_tokens=rank_cap, rank_speeds=topology.rank_speeds)
        rep = pack_complete(cost, tokens, per_rank)
    if rep is None or not _fill_ranks(rep, cost, tokens, fill, dp, m, rank_cap):
        return None
    if not large:  # large ones were balanced by pack_large's pair search (this one is quadratic)
        _improve(rep, cost, tokens, count, fill, dp, rank_cap, same_count=equal_counts, keep_items=m, speeds=speeds)
    return rep


_UNCAPPED: dict = {}  # the last batch's assignment without a token cap (below), and the most tokens a rank held


def _like_items(count: np.ndarray, dp: int) -> bool:
    """Every item holds as many documents, and whole items can keep `dp` ranks' counts within one."""
    return bool(np.all(count == count[0]) and (count[0] == 1 or len(count) % dp == 0))


def timed_equal_counts_start(
    cost: np.ndarray, tokens: np.ndarray, count: np.ndarray, speeds: np.ndarray, cap: int
) -> int | None:
    """Where `assign_replicas` with `equal_counts` on ranks of `speeds` takes the uncapped path (a large batch of
    like items; at every rank cap at least the most tokens a rank holds in it, that assignment is the one made): a
    micro-batch count of `cap` tokens to start looking from, the fewest that hold the fullest rank's tokens scaled
    by the share of them first-fit decreasing places at that count. None elsewhere."""
    if len(cost) < LARGE_UNITS or not _like_items(count, len(speeds)):
        return None
    rep, peak = _uncapped(cost, tokens, speeds)
    full = np.asarray(tokens, dtype=np.int64)[rep == np.argmax(np.bincount(rep, weights=tokens, minlength=len(speeds)))]
    m = max(-(-peak // cap), 1)
    placed = placed_tokens(full, m, cap)
    return m if placed <= 0 else max(m, int(np.ceil(m * full.sum() / placed)))


def _uncapped(cost: np.ndarray, tokens: np.ndarray, speeds: np.ndarray) -> tuple[np.ndarray, int]:
    """(the equal-count assignment on uneven ranks without a token cap, the most tokens a rank held while it was
    made), kept for the last batch asked."""
    dp = len(speeds)
    key = (cost.tobytes(), np.asarray(tokens, dtype=np.int64).tobytes(), speeds.tobytes())
    if key not in _UNCAPPED:
        free = int(np.sum(tokens))  # no rank can exceed it
        rep = lpt_timed(cost, tokens, speeds, free, most=_most(len(cost), speeds))
        assert rep is not None  # uncapped (room for every token on any rank): it always places every item
        peak = max(
            int(np.bincount(rep, weights=tokens, minlength=dp).max()), balance_swaps(rep, cost, tokens, free, speeds)
        )
        _UNCAPPED.clear()
        _UNCAPPED[key] = (rep, peak)
    return _UNCAPPED[key]


def _most(n: int, speeds: np.ndarray) -> np.ndarray:
    """Items per rank when `n` are counted out evenly and the fastest ranks take the one more."""
    low, extra = divmod(n, len(speeds))
    most = np.full(len(speeds), low, dtype=np.int64)
    most[np.argsort(-speeds, kind="stable")[:extra]] += 1
    return most


def _timed_equal_counts(cost: np.ndarray, tokens: np.ndarray, speeds: np.ndarray, rank_cap: int) -> np.ndarray | None:
    """Equal counts on uneven ranks (the fastest ranks take the one more): LPT by finish time, then swaps (which
    keep the counts), within `rank_cap` tokens a rank. "auto" asks this of the same items at several caps: the
    assignment without a cap is kept with the most tokens any rank held while it was made, and where that is
    within `rank_cap` the cap never bound, so it is this cap's assignment too (the same items, decisions, ties)."""
    uncapped, peak = _uncapped(cost, tokens, speeds)
    if peak <= rank_cap:
        return uncapped.copy()
    rep = lpt_timed(cost, tokens, speeds, rank_cap, most=_most(len(cost), speeds))
    if rep is not None:  # swaps keep the counts
        balance_swaps(rep, cost, tokens, rank_cap, speeds)
    return rep


def _fill_ranks(rep, cost, tokens, fill, dp: int, m: int, rank_cap: int) -> bool:
    """Give every rank at least `m` of `fill` (in place): the cheapest item that a rank above `m` can spare moves to
    the rank short of it (token room permitting). False when no move is left."""
    while True:
        have = np.bincount(rep, weights=fill, minlength=dp)
        short = np.flatnonzero(have < m)
        if not len(short):
            return True
        r = int(short[0])
        room = rank_cap - np.bincount(rep, weights=tokens, minlength=dp)[r]
        spare = (have[rep] - fill >= m) & (rep != r) & (tokens <= room)
        if not spare.any():
            return False
        i = int(np.flatnonzero(spare)[np.argmin(cost[spare])])
        rep[i] = r


def restart_ranks(
    rep: np.ndarray,
    cost: np.ndarray,
    tokens: np.ndarray,
    count: np.ndarray,
    fill: Optional[np.ndarray],
    heaviest: np.ndarray,
    k: int,
    topology: Topology,
    options: dict,
) -> np.ndarray:
    """Rank rules with few groups per rank: the joint (step, rank) assignment `rep` (k * dp bins) against
    RESTARTS random starts, each improved by the same move/swap search; kept is the one whose worst step, then
    summed steps, is closest to its bound (`step_ratios`). Deterministic for `options["seed"]`."""
    bins, m = k * topology.dp, topology.micro_batches
    speeds = replica_speeds(topology)
    speeds = None if speeds is None else np.tile(speeds, k)  # bin s * dp + r is rank r of a step
    n = len(cost)
    if n > RESTART_ITEMS * bins:
        return rep  # many items per rank balance well from one start
    rank_cap = m * topology.micro_batch_tokens
    group_bound = options["has_groups"] and options["keep"] == "rank"
    best, best_score = rep, _score(rep, cost, heaviest, k, topology, group_bound)
    rng = np.random.default_rng([int(options["seed"]), 7])
    for _ in range(RESTARTS):
        noisy = cost * rng.uniform(0.6, 1.4, n)  # an LPT order shaken up: a different basin for the search
        try:
            start = _equal_count_lpt(
                cost, tokens, count, bins, rank_cap, np.argsort(-noisy), options["equal_counts"], speeds
            )
        except ValueError:
            start = None
        if start is None or not _fill_ranks(start, cost, tokens, fill, bins, m, rank_cap):
            continue  # a rank must fill its M micro-batches
        _improve(start, cost, tokens, count, fill, bins, rank_cap, options["equal_counts"], keep_items=m, speeds=speeds)
        score = _score(start, cost, heaviest, k, topology, group_bound)
        if score < best_score:
            best, best_score = start, score
    return best


def _score(rep, cost, heaviest, k: int, topology: Topology, group_bound: bool) -> tuple[float, float]:
    """(worst, summed) ratio of the steps' slowest bin to their bound when bins of like load share a step: bound
    `max(W_s / dp, P * heaviest unit, the heaviest kept group)`, in summed cost (pp = 1 time of a rank)."""
    dp = topology.dp
    speeds = replica_speeds(topology)
    load = np.bincount(rep, weights=cost, minlength=k * dp)
    steps = deal_bins(load, k, dp, speeds)
    step_of_bin = np.empty(k * dp, dtype=np.int64)
    step_of_bin[steps.ravel()] = np.repeat(np.arange(k), dp)
    step = step_of_bin[rep]
    unit = np.zeros(k)
    np.maximum.at(unit, step, heaviest)
    if speeds is None:
        bound = np.maximum(load[steps].sum(axis=1) / dp, topology.pp * unit)
    else:
        bound = np.maximum(load[steps].sum(axis=1) / speeds.sum(), topology.pp * unit / speeds.max())
    if group_bound:
        group = np.zeros(k)
        np.maximum.at(group, step, cost)
        bound = np.maximum(bound, group if speeds is None else group / speeds.max())
    ratio = (load[steps] if speeds is None else load[steps] / speeds).max(axis=1) / bound
    return float(ratio.max()), float(ratio.sum())


def _equal_count_lpt(
    cost, tokens, count, dp: int, rank_cap: int, order=None, equal=True, speeds=None
) -> np.ndarray | None:
    """Largest cost first (or items in `order`), each item to the least-loaded rank that keeps every rank's count
    at `n // dp` or one more (at most `n % dp` ranks above; no count rule with `equal=False`) and within
    `rank_cap` tokens. With `speeds` [dp]: to the rank that finishes it first (load plus the item, over speed)."""
    n = int(count.sum())
    low, extra = divmod(n, dp)
    load, cnt, tok = np.zeros(dp), np.zeros(dp, dtype=np.int64), np.zeros(dp, dtype=np.int64)
    rep = np.full(len(cost), -1, dtype=np.int64)
    for i in np.argsort(-cost, kind="stable") if order is None else order:
        new = cnt + count[i]
        by_count = (new <= low) | ((new == low + 1) & (np.count_nonzero(cnt > low) < extra)) | (not equal)
        if not by_count.any():
            raise ValueError(
                f"equal_counts: found no way to give each of {dp} ranks {low} or {low + 1} of {n} documents "
                f"with groups of sizes {sorted(set(count.tolist()))} kept whole; drop equal_counts or "
                "use groups that divide evenly"
            )
        ok = by_count & (tok + tokens[i] <= rank_cap)
        if not ok.any():
            return None
        r = int(np.argmin(np.where(ok, load if speeds is None else (load + cost[i]) / speeds, np.inf)))
        rep[i] = r
        load[r] += cost[i]
        cnt[r] += count[i]
        tok[r] += tokens[i]
    return rep


def _improve(
    rep, cost, tokens, count, fill, dp: int, rank_cap: int, same_count: bool, keep_items: int, speeds=None
) -> None:
    """Local search on the ranks' summed cost (in place), from both ends: lower the slowest rank (moves and swaps),
    then raise the fastest (swaps: the same search on negated costs), while either finds something. Both ends
    matter: steps take ranks of like load, so a light rank is what sets a light step's gap to its bound. With
    `speeds` [dp] the ranks' times are their summed costs over their speeds."""
    # dividing by a speed of exactly 1.0 changes no bit: even ranks search exactly as they always did
    speed = np.ones(dp) if speeds is None else speeds
    for _ in range(4):
        lowered = _search(
            rep, cost, tokens, count, fill, dp, rank_cap, same_count, keep_items, moves=not same_count, speed=speed
        )
        raised = _search(rep, -cost, tokens, count, fill, dp, rank_cap, same_count, keep_items, False, speed=speed)
        if not (lowered or raised):
            return


def _search(
    rep, cost, tokens, count, fill, dp: int, rank_cap: int, same_count: bool, keep_items: int, moves: bool, speed
) -> int:
    """The best move (with `moves`) or swap of an item of the rank of largest summed `cost` with another rank,
    repeated while it lowers the larger of the two ranks' sums; ranks keep at least `keep_items` of `fill` and stay
    within `rank_cap` tokens. Returns the number of changes (in place on `rep`)."""
    load = np.bincount(rep, weights=cost, minlength=dp)
    rtok = np.bincount(rep, weights=tokens, minlength=dp)
    for done in range(SWAP_ROUNDS):
        r = int(np.argmax(load / speed))
        mine, others = np.flatnonzero(rep == r), np.flatnonzero(rep != r)
        if not len(others):
            return done
        q = rep[others]
        delta = cost[mine][:, None] - cost[others][None, :]  # swap i (of r) with j (of q)
        dtok = tokens[mine][:, None] - tokens[others][None, :]
        ok = (delta > 0) & (rtok[r] - dtok <= rank_cap) & (rtok[q][None, :] + dtok <= rank_cap)
        have = np.bincount(rep, weights=fill, minlength=dp)
        dfill = fill[mine][:, None] - fill[others][None, :]
        ok &= (have[r] - dfill >= keep_items) & (have[q][None, :] + dfill >= keep_items)
        if same_count:
            ok &= count[mine][:, None] == count[others][None, :]
        slow, mine_after = load[r] / speed[r], (load[r] - delta) / speed[r]
        gain = np.where(ok, slow - np.maximum(mine_after, (load[q][None, :] + delta) / speed[q][None, :]), -np.inf)
        best = np.unravel_index(int(np.argmax(gain)), gain.shape)
        best_gain, move = float(gain[best]), None
        if moves:
            rank_tok = np.bincount(rep, weights=tokens, minlength=dp)
            move_ok = rank_tok[None, :] + tokens[mine][:, None] <= rank_cap
            move_ok &= (have[r] - fill[mine] >= keep_items)[:, None]
            move_ok[:, r] = False
            left = (load[r] - cost[mine][:, None]) / speed[r]
            move_gain = np.where(move_ok, slow - np.maximum(left, (load + cost[mine][:, None]) / speed), -np.inf)
            mv = np.unravel_index(int(np.argmax(move_gain)), move_gain.shape)
            if move_gain[mv] > best_gain:
                best_gain, move = float(move_gain[mv]), mv
        if best_gain <= 1e-12 * abs(slow):
            return done
        if move is not None:
            i, dest = int(mine[move[0]]), int(move[1])
            _shift(rep, load, rtok, i, dest, cost, tokens)
        else:
            i, j = int(mine[best[0]]), int(others[best[1]])
            dest = int(rep[j])
            _shift(rep, load, rtok, i, dest, cost, tokens)
            _shift(rep, load, rtok, j, r, cost, tokens)
    return SWAP_ROUNDS


def _shift(rep, load, rtok, i: int, dest: int, cost, tokens) -> None:
    load[rep[i]] -= cost[i]
    rtok[rep[i]] -= tokens[i]
    rep[i] = dest
    load[dest] += cost[i]
    rtok[dest] += tokens[i]


def deal_bins(load: np.ndarray, k: int, dp: int, speeds: np.ndarray | None = None) -> np.ndarray:
    """[k, dp] the (step, rank) bins dealt to the steps in order of load, `dp` consecutive bins per step: a step
    waits for its slowest rank, so bins of like load share a step (this minimises the sum over the steps of their
    slowest bin; the steps' work differs only as much as the balanced bins do). With uneven ranks bin `s * dp + r`
    was balanced for rank r's speed: each rank's own bins are dealt to the steps in order of load."""
    if speeds is None:
        return np.argsort(-load, kind="stable").reshape(k, dp)
    own = np.arange(k * dp).reshape(k, dp)  # column r: rank r's bins
    return np.take_along_axis(own, np.argsort(-load[own], axis=0, kind="stable"), axis=0)


def order_for_pipeline(costs: np.ndarray) -> np.ndarray:
    """The micro-batch order of one rank with pipeline stages: the cheapest first, the next cheapest last, and so
    on inwards, so the largest sit in the middle (short 1F1B warm-up and cool-down). Returns the original indices
    in their new order."""
    ascending = np.argsort(np.asarray(costs), kind="stable")
    out = np.empty(len(ascending), dtype=np.int64)
    front, back = 0, len(ascending) - 1
    for k, i in enumerate(ascending):
        if k % 2 == 0:
            out[front] = i
            front += 1
        else:
            out[back] = i
            back -= 1
    return out


def simulate_1f1b(times: Sequence[float] | np.ndarray, stages: int, backward_share: float = 2 / 3) -> float:
    """Makespan of one replica's 1F1B schedule: micro-batch m takes `times[m]` on every stage (forward
    `(1 - backward_share)` of it, backward the rest), in the given order. Equal times give section 3's
    `(P - 1) * t + M * t`; unequal ones depend on the order (what `order_for_pipeline` shortens)."""
    t = np.asarray(times, dtype=np.float64)
    m, p = len(t), int(stages)
    if p == 1:
        return float(t.sum())
    length = {"F": t * (1 - backward_share), "B": t * backward_share}
    ops = []
    for s in range(p):
        warm = min(p - s - 1, m)
        seq = [("F", i) for i in range(warm)]
        for i in range(m - warm):
            seq += [("F", warm + i), ("B", i)]
        ops.append(seq + [("B", i) for i in range(m - warm, m)])
    finish: dict = {}
    pointer, clock = [0] * p, [0.0] * p
    left = 2 * m * p
    while left:
        before = left
        for s in range(p):
            while pointer[s] < len(ops[s]):
                kind, i = ops[s][pointer[s]]
                if kind == "F":
                    dep = ("F", s - 1, i) if s > 0 else None
                else:
                    dep = ("B", s + 1, i) if s < p - 1 else ("F", s, i)
                if dep is not None and dep not in finish:
                    break
                clock[s] = max(clock[s], finish[dep] if dep else 0.0) + length[kind][i]
                finish[(kind, s, i)] = clock[s]
                pointer[s] += 1
                left -= 1
        if left == before:
            raise RuntimeError("1F1B schedule deadlocked")  # cannot happen for a valid 1F1B order
    return max(clock)


def pipeline_times(plan: Plan, backward_share: float = 2 / 3) -> np.ndarray:
    """[steps] simulated 1F1B step times of a static plan, micro-batches in the plan's order (per CP rank; with
    pp = 1 exactly `Plan.step_times`)."""
    if plan.dynamic:
        raise ValueError("pipeline_times simulates static plans (dynamic plans use the slot model of step_times)")
    t = plan.topology
    mb = plan.micro_batch_costs() / t.cp
    return np.array(
        [max(simulate_1f1b(mb[s, r], t.pp, backward_share) for r in range(t.dp)) for s in range(plan.num_steps)]
    )
