"""Pair repartition: a bounded refinement of one small step of a fixed batch (pp = 1, static CP).

With one pipeline stage a replica's time is its summed cost over its speed, whatever the split into micro-batches,
so the step time is set by which items each replica holds. The move/swap search that packs a step changes one or
two items at a time and stops in a local optimum, often a few hundredths of a percent above the step's bound on
slices of a few dozen documents. This pass takes the slowest replica and another one (the fastest first) and
splits the items of both anew, exactly: every subset of their items (at most `MAX_UNION`, the smallest ones; the
rest stay where they are) is scored by meet in the middle (two halves of 2^12 subset sums, each subset of one half
matched by binary search to the sums of the other), the best splits within each replica's token room and item
count are tried in order, and the first whose two replicas pack into their M micro-batches (`pack_complete` on one
replica) replaces the pair. Where no split does, one item of the slowest replica is traded for the fewest of the
other's items, cheapest per token first, that make room for it (`_trade`: a replica full of short documents takes a
long one for short ones of as many tokens, which moves work without moving tokens; heavy-tailed slices end with
such a replica). Repeated while it lowers the slowest replica, at most `ROUNDS` times.

The result is never slower than its input (a split is taken only when the larger of the pair's two new times is
below the slowest replica's), is deterministic, and keeps every rule of the input: each micro-batch within
`max_tokens * cp` tokens and non-empty.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from balancer.planning.speeds import replica_speeds, with_speeds
from balancer.planning.topology import Topology

MAX_UNION = 24  # items of a pair split anew (the smallest ones; more stay put): 2 x 2^12 subsets
ROUNDS = 48  # most pair splits or trades per step
TRIES = 6  # best splits tried per pair, in order, until one packs into both replicas' micro-batches
AT_BOUND = 1e-5  # the slowest replica this close to the bound: done
NEIGHBOURS = 6  # matches of a half's subset looked at on each side of its binary-search position


def repartition_pairs(
    bins: np.ndarray,
    cost: np.ndarray,
    tokens: np.ndarray,
    topology: Topology,
    pack_one: Callable[[np.ndarray, np.ndarray, Topology], np.ndarray | None],
) -> np.ndarray:
    """Micro-batch (replica * M + m) of every item after the pair splits (module docstring); `bins` is left as it
    is. `pack_one(cost, tokens, one_replica_topology)` packs one replica's items (None: they do not fit)."""
    dp, m = topology.dp, topology.micro_batches
    if dp == 1 or topology.pp > 1 or topology.dynamic or len(cost) < 2 * m:
        return bins
    speeds = replica_speeds(topology)
    speed = np.ones(dp) if speeds is None else speeds
    one = with_speeds(topology, None, dp=1, tokens_per_step=None)
    room = m * topology.micro_batch_tokens
    bins = bins.copy()
    cost = np.asarray(cost, dtype=np.float64)
    tokens = np.asarray(tokens, dtype=np.int64)
    bound = max(cost.sum() / speed.sum(), cost.max() / speed.max())  # no split of the items is faster
    for _ in range(ROUNDS):
        time = np.bincount(bins // m, weights=cost, minlength=dp) / speed
        r = int(np.argmax(time))
        if time[r] <= bound * (1 + AT_BOUND):
            break
        faster = [q for q in np.argsort(time, kind="stable").tolist() if time[q] < time[r] * (1 - 1e-12)]
        pair = (r, speed[r], float(time[r]), room)
        if not any(
            _split_pair(bins, cost, tokens, pair, q, float(speed[q]), one, pack_one)
            or _trade(bins, cost, tokens, pair, q, float(speed[q]), one, pack_one)
            for q in faster
        ):
            break
    return bins


def _split_pair(bins, cost, tokens, pair: tuple, q: int, s_q: float, one: Topology, pack_one) -> bool:
    """Split the items of the slowest replica r (`pair`: r, its speed, its time, the token room) and replica q anew
    (in place on `bins`); False when no split lowers r's time and packs."""
    r, s_r, slowest, room = pair
    m = one.micro_batches
    both = np.flatnonzero((bins // m == r) | (bins // m == q))
    by_cost = both[np.argsort(cost[both], kind="stable")]
    free, fixed = by_cost[:MAX_UNION], by_cost[MAX_UNION:]
    on_r = fixed[bins[fixed] // m == r]
    base = np.array([cost[on_r].sum(), tokens[on_r].sum(), len(on_r)], dtype=np.float64)
    rest = np.array([cost[fixed].sum(), tokens[fixed].sum(), len(fixed)], dtype=np.float64) - base
    for mask in _best_splits(cost[free], tokens[free], base, rest, (s_r, s_q), slowest, room, m):
        a = np.concatenate([on_r, free[mask]])
        if _place_pair(bins, cost, tokens, (r, a), (q, np.setdiff1d(both, a, assume_unique=True)), one, pack_one):
            return True
    return False


def _trade(bins, cost, tokens, pair: tuple, q: int, s_q: float, one: Topology, pack_one) -> bool:
    """One item of the slowest replica r for the fewest of q's items, cheapest per token first, that make room for
    it in q's tokens (in place on `bins`): where q is full of short documents, a long one of r goes to q for short
    ones holding as many tokens, which moves work without moving tokens (the pair splits change a few dozen of the
    cheapest items, too few tokens for that). The trades that lower the larger of the two times most are tried in
    order (TRIES) until both replicas pack; False when none does."""
    r, s_r, slowest, room = pair
    m = one.micro_batches
    mine, theirs = np.flatnonzero(bins // m == r), np.flatnonzero(bins // m == q)
    offer = theirs[np.lexsort((theirs, cost[theirs] / np.maximum(tokens[theirs], 1)))]
    cum_tok = np.concatenate([[0], np.cumsum(tokens[offer])])
    cum_cost = np.concatenate([[0.0], np.cumsum(cost[offer])])
    used_r, used_q = int(tokens[mine].sum()), int(tokens[theirs].sum())
    k = np.searchsorted(cum_tok, tokens[mine] - (room - used_q), side="left")  # q's items given for each of r's
    k = np.minimum(k, len(offer))
    delta = cost[mine] - cum_cost[k]  # work moved from r to q
    worst = np.maximum((cost[mine].sum() - delta) / s_r, (cost[theirs].sum() + delta) / s_q)
    ok = (delta > 0) & (worst < slowest * (1 - 1e-12)) & (k >= 1) & (cum_tok[k] + room - used_q >= tokens[mine])
    ok &= (used_r - tokens[mine] + cum_tok[k] <= room) & (len(theirs) - k + 1 >= m) & (len(mine) - 1 + k >= m)
    for c in np.flatnonzero(ok)[np.argsort(worst[ok], kind="stable")][:TRIES].tolist():
        a = np.concatenate([np.setdiff1d(mine, mine[c : c + 1], assume_unique=True), offer[: k[c]]])
        b = np.concatenate([offer[k[c] :], mine[c : c + 1]])
        if _place_pair(bins, cost, tokens, (r, a), (q, b), one, pack_one):
            return True
    return False


def _place_pair(bins, cost, tokens, side_a: tuple, side_b: tuple, one: Topology, pack_one) -> bool:
    """Pack each side's items (`(replica, items)`) into its replica's micro-batches and write them to `bins`; nothing
    written and False when either side does not pack."""
    (r, a), (q, b) = side_a, side_b
    packed_a = pack_one(cost[a], tokens[a], one)
    packed_b = None if packed_a is None else pack_one(cost[b], tokens[b], one)
    if packed_b is None:
        return False
    m = one.micro_batches
    bins[a] = r * m + packed_a
    bins[b] = q * m + packed_b
    return True


def _best_splits(cost, tokens, base, rest, speeds, slowest: float, room: int, m: int) -> list[np.ndarray]:
    """Up to TRIES boolean masks over the free items (True: to replica r), best first by the larger of the two
    replicas' times, each below `slowest`, within `room` tokens and holding at least `m` items on both sides.
    `base` / `rest`: (cost, tokens, count) of the fixed items on r / on the other replica."""
    n = len(cost)
    half = n // 2
    left, right = _subsets(cost[:half], tokens[:half]), _subsets(cost[half:], tokens[half:])
    total = cost.sum() + base[0] + rest[0]
    s_r, s_q = speeds
    aim = total * s_r / (s_r + s_q) - base[0]  # r's share of the free cost that equalises the two times
    order = np.argsort(right[0], kind="stable")
    right_sorted = right[:, order]
    at = np.searchsorted(right_sorted[0], aim - left[0])
    li = np.repeat(np.arange(left.shape[1]), 2 * NEIGHBOURS)
    ri = np.clip(at[:, None] + np.arange(-NEIGHBOURS, NEIGHBOURS)[None, :], 0, right.shape[1] - 1).ravel()
    got = left[:, li] + right_sorted[:, ri] + base[:, None]  # (cost, tokens, count) on r
    free_total = np.array([cost.sum(), tokens.sum(), n], dtype=np.float64)[:, None]
    away = rest[:, None] + free_total - (got - base[:, None])  # on the other replica
    worst = np.maximum(got[0] / s_r, away[0] / s_q)
    ok = (worst < slowest * (1 - 1e-12)) & (got[1] <= room) & (away[1] <= room) & (got[2] >= m) & (away[2] >= m)
    if not ok.any():
        return []
    cand = np.flatnonzero(ok)
    cand = cand[np.lexsort((cand, worst[cand]))]
    out, seen = [], set()
    for c in cand.tolist():
        key = (int(li[c]), int(order[ri[c]]))
        if key in seen:
            continue
        seen.add(key)
        out.append(np.concatenate([_bits(key[0], half), _bits(key[1], n - half)]))
        if len(out) == TRIES:
            break
    return out


def _subsets(cost: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """[3, 2^k] (cost, tokens, count) of every subset of k items, subset s holding item i when bit i of s is set."""
    bits = (np.arange(1 << len(cost))[:, None] >> np.arange(len(cost))[None, :]) & 1
    return np.stack([bits @ cost, bits @ tokens.astype(np.float64), bits.sum(axis=1).astype(np.float64)])


def _bits(subset: int, k: int) -> np.ndarray:
    return ((subset >> np.arange(k)) & 1).astype(bool)
