"""Packing a large step of a fixed batch (thousands of units) in near-linear time.

`pack_step` followed by the move/swap search (`balancer.planning.batch.pack.pack_complete`) considers every pair of
units of the slowest replica and the others in every round: quadratic in the step's units, minutes for a GRPO
batch of 16K rollouts. With that many units the balance is easy to reach without it, in two levels:

1. *Replicas.* Units largest cost first, each to the replica with the least work that has token room
   (`M * max_tokens * cp`): LPT, which leaves the replicas apart by about one small unit. Then, while it lowers the
   slowest replica, the best single move or swap between the slowest and the fastest replica, found by binary
   search in the fastest one's sorted costs (O(k log k) a round, not O(k^2)). Where that leaves the slowest
   replica over 0.1% above its bound (one unit outweighing a replica's share: its replica got every dp-th unit
   after it too), LPT with at least M units a replica is tried as well and the faster plan kept.
2. *Micro-batches.* Each replica's units go to its `M` micro-batches: with one pipeline stage a replica's time is
   the sum of its micro-batches whatever the split, so tokens are balanced (LPT on tokens within the cap: the most
   headroom); with `pp > 1` the largest micro-batch also counts, so costs are balanced (LPT on cost within the cap).
   Where the cap defeats LPT, first-fit decreasing on tokens is tried before giving up.

Uneven ranks (`speeds`, one per replica): a replica's time is its work over its speed. Level 1 then deals the
units back and forth to virtual bins, each replica holding bins in proportion to its speed (a fast replica whose
speed share of the tokens exceeds its token room: in proportion to that room), so every replica holds a mix of
sizes, then runs the pair search between the slowest and the fastest replica by time, aiming each exchange at the
cost that equalises the two times. Where a replica filled to its room does not split into M micro-batches, its room
is lowered to what first-fit decreasing placed of it and level 1 redone (at most CAP_TRIES times). Level 2 is
unchanged (within a replica the speed scales every micro-batch alike). (LPT by finish time filled a fast replica
to its last token with large units only, which then did not split: "auto" took extra counts, each costing a spill.)

Every micro-batch gets at least one unit (LPT fills the empty ones first). The result is a deterministic function
of the inputs (stable sorts, ties to the lower index).
"""

from __future__ import annotations

import heapq

import numpy as np

from balancer.planning.topology import Topology

LARGE_UNITS = 2048  # steps with at least this many units take this path (smaller ones keep the exact search)
PAIR_ROUNDS = 256  # most improving moves/swaps between the slowest and the fastest replica
SPEED_BINS = 20  # uneven ranks: virtual bins of the smallest share in the weighted deal (rounding within 2.5%)
CAP_TRIES = 3  # uneven ranks: pair searches under a lowered token cap before the step is given up
LPT_GAP = 1e-3  # the deal's slowest replica this far above the bound also tries LPT


def pack_large(
    cost: np.ndarray, tokens: np.ndarray, topology: Topology, speeds: np.ndarray | None = None
) -> np.ndarray | None:
    """Micro-batch (replica * M + m) of every unit of one large step, or None when it does not fit `topology`
    (a replica over its tokens, or with fewer units than micro-batches). `speeds` [dp]: the replicas' speeds (None:
    even ranks)."""
    dp, m = topology.dp, topology.micro_batches
    tokens = np.asarray(tokens, dtype=np.int64)
    if dp == 1:
        return _micro_batches(np.zeros(len(cost), dtype=np.int64), cost, tokens, topology)
    room = m * topology.micro_batch_tokens
    if speeds is not None:
        return _pack_timed(cost, tokens, topology, speeds)
    bound = max(float(cost.max()), float(cost.sum()) / dp)  # no replica assignment has a faster slowest replica
    rep = _replicas(cost, tokens, dp, room, m, lpt=False)
    best = None if rep is None else _micro_batches(rep, cost, tokens, topology)
    if best is None:  # the step does not fit this way (the caller may try more micro-batches): as it was
        return None
    top = float(np.bincount(best // m, weights=cost, minlength=dp).max())
    if top <= bound * (1 + LPT_GAP):
        return best
    # a unit outweighs a replica's share: LPT, whose token-tighter replicas may need some units spilled
    rep = _replicas(cost, tokens, dp, room, m, lpt=True)
    if rep is None:
        return best
    bins = _micro_batches(rep, cost, tokens, topology)
    if bins is None:
        bins = _spill(rep, cost, tokens, topology)
    if bins is not None and float(np.bincount(bins // m, weights=cost, minlength=dp).max()) < top:
        return bins
    return best


def _pack_timed(cost: np.ndarray, tokens: np.ndarray, topology: Topology, speeds: np.ndarray) -> np.ndarray | None:
    """Uneven ranks: the units dealt back and forth to virtual bins, each replica holding bins in proportion to its
    share of the work (`_weighted_deal`: its speed's share, lowered to what `cap` tokens hold where that is less),
    then the pair search by time (moves and swaps from the slowest to the fastest replica, within `cap` tokens a
    replica), then the micro-batches. Where a replica filled to `cap` does not split into M micro-batches, `cap` is
    lowered to the tokens first-fit decreasing placed of it and the deal redone (at most CAP_TRIES times). Every
    replica's units are a mix of sizes (dealt, not filled largest first), so they split as well as on even ranks;
    where none of those splits, the even-ranks plan is taken if it does. None when the step does not fit."""
    dp, m = topology.dp, topology.micro_batches
    cap = m * topology.micro_batch_tokens
    room = cap
    for _ in range(CAP_TRIES):
        rep = _weighted_deal(cost, tokens, speeds, cap, room)
        if rep is not None:
            _fill_short(rep, cost, tokens, m, room)
        if rep is None:
            rep = _deal(cost, tokens, dp, room)
        if rep is None:
            return None
        _balance_pairs(rep, cost, tokens, dp, cap, m, speeds=speeds)
        bins, placed = _micro_batches_or_placed(rep, cost, tokens, topology)
        if bins is not None:
            return bins
        if not 0 < placed < cap:
            break
        cap = placed
    rep = _replicas(cost, tokens, dp, room, m, lpt=False)  # the speed-blind plan where it splits and these did not
    return None if rep is None else _micro_batches(rep, cost, tokens, topology)


def _weighted_deal(cost: np.ndarray, tokens: np.ndarray, speeds: np.ndarray, cap: int, room: int) -> np.ndarray | None:
    """Replica of every unit dealt back and forth, largest cost first, to virtual bins, replica r holding bins in
    proportion to its share of the work: its speed's share, or where that share of the tokens is over `cap` the
    share that fills it, the rest shared by speed among the others (SPEED_BINS bins for the smallest share). None
    when a replica's tokens then break `room` or there are fewer units than bins."""
    total = float(tokens.sum())
    share, fixed = np.asarray(speeds, dtype=np.float64), np.zeros(len(speeds), dtype=bool)
    while True:  # water-filling: replicas whose share of the tokens is over the cap hold the cap
        free = ~fixed
        share = np.where(fixed, cap / total, (1 - fixed.sum() * cap / total) * speeds / speeds[free].sum())
        over = free & (share * total > cap)
        if not over.any() or over.sum() == free.sum():
            break
        fixed |= over
    if share.min() <= 0:
        return None
    bins = np.maximum(np.rint(SPEED_BINS * share / share.min()), 1).astype(np.int64)
    if len(cost) < bins.sum():  # a share far below the others' (a rank 100x slower): one unit a bin at most
        bins = np.maximum(np.floor(len(cost) * share / share.sum()), 1).astype(np.int64)
    if len(cost) < bins.sum():
        return None
    owner = np.repeat(np.arange(len(speeds)), bins)  # interleaved: replica r's j-th bin at (j + 1/2) / bins[r]
    owner = owner[
        np.argsort((np.arange(len(owner)) - np.repeat(np.cumsum(bins) - bins, bins) + 0.5) / bins[owner], kind="stable")
    ]
    rep = owner[_snake(np.argsort(-np.asarray(cost, dtype=np.float64), kind="stable"), len(owner))]
    return rep if np.bincount(rep, weights=tokens, minlength=len(speeds)).max() <= room else None


def _fill_short(rep: np.ndarray, cost: np.ndarray, tokens: np.ndarray, m: int, room: int) -> None:
    """Give every replica at least `m` units (in place): a replica whose speed share is fewer units than its
    micro-batches (a rank far slower than the others) takes the cheapest units of the replicas above `m`, within
    `room` tokens, so that the pair search starts from a split where it holds the cheapest units, not none."""
    dp = int(rep.max()) + 1 if len(rep) else 0
    count = np.bincount(rep, minlength=dp)
    short = np.flatnonzero(count < m)
    if not len(short):
        return
    load = np.bincount(rep, weights=tokens, minlength=dp)
    for u in np.argsort(cost, kind="stable").tolist():
        if not len(short):
            return
        src, r = int(rep[u]), int(short[0])
        if count[src] <= m or load[r] + tokens[u] > room:
            continue
        rep[u] = r
        count[src] -= 1
        count[r] += 1
        load[src] -= tokens[u]
        load[r] += tokens[u]
        if count[r] >= m:
            short = short[1:]


def _micro_batches_or_placed(rep, cost, tokens, topology: Topology) -> tuple[np.ndarray | None, int]:
    """(`_micro_batches(rep, ...)`, 0), or where a replica's units do not split: (None, the tokens first-fit
    decreasing places of the first such replica's units; 0 when it has fewer units than micro-batches)."""
    m, cap = topology.micro_batches, topology.micro_batch_tokens
    bins = np.empty(len(cost), dtype=np.int64)
    for r in range(topology.dp):
        mine = np.flatnonzero(rep == r)
        if len(mine) < m:
            return None, 0
        local = _deal(tokens[mine] if topology.pp == 1 else cost[mine], tokens[mine], m, cap)
        if local is None:  # first-fit decreasing, where a unit that fits nowhere gets -1 (the rest as without)
            local = _first_fit(tokens[mine], m, cap, partial=True)
            if local is None:
                return None, 0
            if (local < 0).any():
                return None, int(tokens[mine][local >= 0].sum())
        bins[mine] = r * m + local
    return bins, 0


def _spill(rep: np.ndarray, cost: np.ndarray, tokens: np.ndarray, topology: Topology) -> np.ndarray | None:
    """Micro-batches of the replica assignment `rep` when some replica's units do not split within the cap: each
    replica first-fit decreasing on tokens, and what does not fit goes, largest first, to the micro-batch with the
    most room on the least loaded replica that has room for it. None when a unit fits nowhere."""
    dp, m, cap = topology.dp, topology.micro_batches, topology.micro_batch_tokens
    bins = np.full(len(cost), -1, dtype=np.int64)
    left = np.full(dp * m, cap, dtype=np.int64)
    for r in range(dp):
        mine = np.flatnonzero(rep == r)
        if len(mine) < m:
            return None
        local = _deal(tokens[mine], tokens[mine], m, cap)
        if local is None:
            local = _first_fit(tokens[mine], m, cap, partial=True)
        if local is None:  # the m largest overflow a micro-batch: no deal of this replica
            return None
        placed = local >= 0
        bins[mine[placed]] = r * m + local[placed]
    left -= np.bincount(bins[bins >= 0], weights=tokens[bins >= 0], minlength=dp * m).astype(np.int64)
    load = np.bincount(rep, weights=cost, minlength=dp)
    rest = np.flatnonzero(bins < 0)
    for i in rest[np.argsort(-tokens[rest], kind="stable")].tolist():
        fits = left >= tokens[i]
        if not fits.any():
            return None
        ok_rep = fits.reshape(dp, m).any(axis=1)
        r = int(np.argmin(np.where(ok_rep, load, np.inf)))
        b = r * m + int(np.argmax(np.where(fits[r * m : (r + 1) * m], left[r * m : (r + 1) * m], -1)))
        bins[i] = b
        left[b] -= tokens[i]
        load[rep[i]] -= cost[i]
        load[r] += cost[i]
    return bins


def pack_replica(cost: np.ndarray, tokens: np.ndarray, topology: Topology) -> np.ndarray | None:
    """Micro-batch of every unit of one replica (`topology.dp == 1`): level 2 alone (tokens balanced within the cap
    with one pipeline stage, costs with several), None when the units do not fill its M micro-batches within the
    cap. Linear-time; for a replica whose time does not depend on the split (pp = 1)."""
    return _micro_batches(np.zeros(len(cost), dtype=np.int64), cost, np.asarray(tokens, dtype=np.int64), topology)


def _micro_batches(rep: np.ndarray, cost: np.ndarray, tokens: np.ndarray, topology: Topology) -> np.ndarray | None:
    """Micro-batch of every unit given its replica `rep`, or None when a replica's units do not fill its M."""
    m, cap = topology.micro_batches, topology.micro_batch_tokens
    bins = np.empty(len(cost), dtype=np.int64)
    for r in range(topology.dp):
        mine = np.flatnonzero(rep == r)
        if len(mine) < m:
            return None
        key = tokens[mine] if topology.pp == 1 else cost[mine]
        local = _deal(key, tokens[mine], m, cap)
        if local is None:
            local = _first_fit(tokens[mine], m, cap)
        if local is None:
            return None
        bins[mine] = r * m + local
    return bins


def _replicas(cost: np.ndarray, tokens: np.ndarray, dp: int, room: int, keep: int, lpt: bool) -> np.ndarray | None:
    """Replica of every unit: the back-and-forth deal, or with `lpt` LPT (each replica keeping `keep` units), then
    the pair search. The deal alone fails where one unit outweighs a replica's share: its replica also gets every
    k-th unit after it, more than the pair search's rounds move off again; LPT gives that replica nothing more."""
    rep = _lpt(cost, tokens, dp, room, keep=keep) if lpt else _deal(cost, tokens, dp, room)
    if rep is not None:
        _balance_pairs(rep, cost, tokens, dp, room, keep)
    return rep


def lpt_timed(
    weight: np.ndarray, tokens: np.ndarray, speeds: np.ndarray, room: int, keep: int = 0, most: np.ndarray | None = None
) -> np.ndarray | None:
    """LPT on uneven bins: largest `weight` first, each item to the bin that would finish it first (its weight plus
    the item's, over its speed; ties: the lower bin) among those within `room` tokens (and below `most` items per
    bin when given); once the items left are just enough to give every bin `keep` items, only bins short of `keep`
    take them. None when an item fits no bin. O(n * bins), one vector step per item."""
    k, n = len(speeds), len(weight)
    if n < k * keep:
        return None
    weight = np.asarray(weight, dtype=np.float64)
    out = np.empty(n, dtype=np.int64)
    load, used, have = [0.0] * k, [0] * k, [0] * k
    limit = [n] * k if most is None else [int(x) for x in most]
    speed, bins = [float(x) for x in speeds], range(k)
    short = k * keep  # items still owed to bins below `keep`
    w_list, t_list = weight.tolist(), np.asarray(tokens).tolist()
    for left, i in enumerate(np.argsort(-weight, kind="stable").tolist()):
        w, t = w_list[i], t_list[i]
        only_short = n - left <= short
        best, finish = -1, float("inf")
        for c in bins:  # plain lists: a handful of bins costs less than one numpy call
            if used[c] + t <= room and have[c] < limit[c] and not (only_short and have[c] >= keep):
                f = (load[c] + w) / speed[c]
                if f < finish:
                    best, finish = c, f
        if best < 0:
            return None
        out[i] = best
        load[best] += w
        used[best] += t
        if have[best] < keep:
            short -= 1
        have[best] += 1
    return out


def balance_swaps(rep: np.ndarray, cost: np.ndarray, tokens: np.ndarray, room: int, speeds: np.ndarray) -> int:
    """In place: the pair search by time (swaps only, so every bin keeps its item count) between the slowest and
    the fastest of the `len(speeds)` bins. Returns the most tokens a bin held at any point of the search (under any
    `room` at least that, the search makes exactly these swaps)."""
    return _balance_pairs(rep, cost, np.asarray(tokens, dtype=np.int64), len(speeds), room, len(cost), False, speeds)


def deal_equal_counts(cost: np.ndarray, tokens: np.ndarray, k: int, room: int) -> np.ndarray | None:
    """Bin of every item (all of one document count) such that every bin holds `n // k` or one more items and the
    bins' costs are even: dealt back and forth largest first, then improved by swaps only (which keep the counts)
    between the slowest and the fastest bin. None when the deal breaks the token `room`."""
    order = np.argsort(-np.asarray(cost, dtype=np.float64), kind="stable")
    out = _snake(order, k)
    if np.bincount(out, weights=tokens, minlength=k).max() > room:
        return None
    _balance_pairs(out, cost, np.asarray(tokens, dtype=np.int64), k, room, keep=len(cost), moves=False)
    return out


def _snake(order: np.ndarray, k: int) -> np.ndarray:
    """Bin of every item when the items, in `order`, are dealt to `k` bins 0..k-1, k-1..0, 0..k-1, ..."""
    lap, pos = np.divmod(np.arange(len(order)), k)
    out = np.empty(len(order), dtype=np.int64)
    out[order] = np.where(lap % 2 == 0, pos, k - 1 - pos)
    return out


def _deal(weight: np.ndarray, tokens: np.ndarray, k: int, room: int) -> np.ndarray | None:
    """Items largest `weight` first dealt to the `k` bins back and forth (0..k-1, k-1..0, ...), which leaves the
    bins' weights apart by about the largest item; LPT (`_lpt`) where that breaks the token `room`. Vectorised:
    the common case costs one sort."""
    order = np.argsort(-np.asarray(weight, dtype=np.float64), kind="stable")
    out = _snake(order, k)
    if np.bincount(out, weights=tokens, minlength=k).max() <= room:
        return out
    return _lpt(weight, tokens, k, room)


def _lpt(weight: np.ndarray, tokens: np.ndarray, k: int, room: int, keep: int = 0) -> np.ndarray | None:
    """Largest `weight` first, each item to the bin of least weight (ties: the lower bin) whose tokens stay within
    `room`; once the items left are just enough to give every bin `keep` items, only bins short of `keep` take
    them. None when an item fits no bin (or there are fewer than `k * keep` items)."""
    n = len(weight)
    if n < k * keep:
        return None
    out = np.empty(n, dtype=np.int64)
    heap = [(0.0, b) for b in range(k)]
    used, have = [0] * k, [0] * k
    short = k * keep  # items still owed to bins below `keep`
    order = np.argsort(-np.asarray(weight, dtype=np.float64), kind="stable")
    w_list, t_list = np.asarray(weight, dtype=np.float64).tolist(), tokens.tolist()
    for left, i in enumerate(order.tolist()):
        w, t = w_list[i], t_list[i]
        only_short = n - left <= short
        skipped = []
        while heap and (used[heap[0][1]] + t > room or (only_short and have[heap[0][1]] >= keep)):
            skipped.append(heapq.heappop(heap))
        if not heap:
            return None
        load, b = heapq.heappop(heap)
        out[i] = b
        used[b] += t
        if have[b] < keep:
            short -= 1
        have[b] += 1
        heapq.heappush(heap, (load + w, b))
        for entry in skipped:
            heapq.heappush(heap, entry)
    return out


def placed_tokens(tokens: np.ndarray, k: int, room: int) -> int:
    """The tokens first-fit decreasing places into `k` bins of `room` tokens (an item that fits no bin left out;
    `_first_fit`); 0 with fewer items than bins or where one of the k largest overflows a bin."""
    tokens = np.asarray(tokens, dtype=np.int64)
    local = _first_fit(tokens, k, room, partial=True)
    return 0 if local is None else int(tokens[local >= 0].sum())


def _first_fit(tokens: np.ndarray, k: int, room: int, partial: bool = False) -> np.ndarray | None:
    """First-fit decreasing on tokens into `k` bins of `room` tokens, every bin non-empty; None when it fails (with
    `partial`, an item that fits no bin gets -1 instead, once the k largest opened the bins)."""
    order = np.argsort(-tokens, kind="stable")
    if len(order) < k:
        return None
    out = np.empty(len(tokens), dtype=np.int64)
    left = np.full(k, room, dtype=np.int64)
    out[order[:k]] = np.arange(k)  # the k largest open the k bins
    left -= tokens[order[:k]]
    if (left < 0).any():
        return None
    for i in order[k:].tolist():
        b = int(np.argmax(left >= tokens[i]))
        if left[b] < tokens[i]:
            if not partial:
                return None
            out[i] = -1
            continue
        out[i] = b
        left[b] -= tokens[i]
    return out


def _balance_pairs(
    rep: np.ndarray,
    cost: np.ndarray,
    tokens: np.ndarray,
    dp: int,
    room: int,
    keep: int,
    moves: bool = True,
    speeds: np.ndarray | None = None,
) -> int:
    """In place: while it lowers the slowest replica's time, the best move or swap of units between the slowest and
    the fastest replica (token room kept, a replica keeps at least `keep` units for its micro-batches); the best is
    the one bringing the two closest to equal times (even ranks: to their mean work). Returns the most tokens a
    replica held at any point (the search is the same under any `room` at least that)."""
    load = np.bincount(rep, weights=cost, minlength=dp)
    used = np.bincount(rep, weights=tokens, minlength=dp).astype(np.int64)
    peak = int(used.max())
    for _ in range(PAIR_ROUNDS):
        time = load if speeds is None else load / speeds
        r, q = int(np.argmax(time)), int(np.argmin(time))
        if r == q or time[r] - time[q] <= 1e-12 * time[r]:
            return peak
        if speeds is None:
            gap = load[r] - load[q]
            target = gap / 2
        else:  # the cost moved from r to q that equalises their times, and the most that still lowers r's time
            s_r, s_q = float(speeds[r]), float(speeds[q])
            target = (load[r] * s_q - load[q] * s_r) / (s_r + s_q)
            gap = load[r] * s_q / s_r - load[q]
        mine = np.flatnonzero(rep == r)
        best = _best_exchange(
            mine, np.flatnonzero(rep == q), cost, tokens, (gap, target), used, r, q, room, moves and len(mine) > keep
        )
        if best is None:
            return peak
        i, j, delta = best
        rep[i] = q
        used[r] -= tokens[i]
        used[q] += tokens[i]
        if j >= 0:
            rep[j] = r
            used[r] += tokens[j]
            used[q] -= tokens[j]
        load[r] -= delta
        load[q] += delta
        peak = max(peak, int(used[r]), int(used[q]))
    return peak


def _best_exchange(mine, theirs, cost, tokens, aim: tuple, used, r: int, q: int, room: int, may_move: bool):
    """(unit of r, unit of q or -1 for a move, cost moved) whose transfer `delta` (0 < delta < gap) is closest to
    the target, `aim = (gap, target)` (even ranks: target gap / 2), within token room (moves only when
    `may_move`); None when none lowers the larger of the two."""
    gap, target = aim
    c_mine = cost[mine]
    candidates = []  # (2 |target - delta|, i, j, delta): with target gap / 2 exactly |gap - 2 delta|
    fits = (used[q] + tokens[mine] <= room) & may_move
    movable = fits & (c_mine > 0) & (c_mine < gap)
    if movable.any():
        k = int(np.argmin(np.where(movable, np.abs(2 * target - 2 * c_mine), np.inf)))
        candidates.append((abs(2 * target - 2 * c_mine[k]), int(mine[k]), -1, float(c_mine[k])))
    if len(theirs):
        order = np.argsort(cost[theirs], kind="stable")
        sorted_theirs, c_theirs = theirs[order], cost[theirs][order]
        at = np.searchsorted(c_theirs, c_mine - target)
        for shift in (-1, 0):
            j = np.clip(at + shift, 0, len(c_theirs) - 1)
            partner = sorted_theirs[j]
            delta = c_mine - c_theirs[j]
            shift_tok = tokens[mine] - tokens[partner]
            ok = (delta > 0) & (delta < gap) & (used[q] + shift_tok <= room) & (used[r] - shift_tok <= room)
            if ok.any():
                k = int(np.argmin(np.where(ok, np.abs(2 * target - 2 * delta), np.inf)))
                candidates.append((abs(2 * target - 2 * delta[k]), int(mine[k]), int(partner[k]), float(delta[k])))
    if not candidates:
        return None
    _, i, j, delta = min(candidates)
    return i, j, delta
