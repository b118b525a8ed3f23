"""Replica refinement of packed steps (cp = pp = 1 ... any static CP, pp = 1): a replica's step time is the sum of
its micro-batches, so only which replica holds a unit matters, not which of its micro-batches. For the steps furthest
above their bound, move or swap units from the slowest replica to others while every micro-batch stays within
`max_tokens * cp` and non-empty, taking each time the move or swap that lowers the step time most (of replicas tied
at the top, one at a time). Where the other replicas are token-full, a unit trades places with the shortest units of
a micro-batch elsewhere that free its tokens: attention is quadratic, so many short units cost less than one long
unit of the same tokens."""

from __future__ import annotations

import numpy as np

from balancer.planning.packing.refine_small import SmallState, improve_small
from balancer.planning.speeds import uneven
from balancer.planning.topology import Topology

TOLERANCE = 0.002  # a step within 0.2% of its bound is left as it is
MAX_STEPS_SHARE = 1 / 32  # at most this share of the steps (the furthest above their bound; at least MIN_STEPS)
MIN_STEPS = 64
MAX_ROUNDS = 48  # moves or swaps per step
ROUND_BUDGET = 1024  # moves or swaps per epoch (or window), steps taken furthest above their bound first
SMALL_STEP = 256  # steps of at most this many units search on Python lists (refine_small: the same changes)


def refine_packed(packed: list, u_cost: np.ndarray, u_tok: np.ndarray, topology: Topology) -> list:
    """`packed`: pieces (units sorted by step and micro-batch, [steps, micro-batches] sizes) as the settle pass
    returns them; the same pieces with units moved between replicas where that lowers a step's time. Deterministic;
    a no-op for pp > 1 (a pipeline's time also depends on its largest micro-batch), dynamic CP and uneven rank
    speeds (its moves compare unweighted replica times, which would undo the speed-proportional shares)."""
    if topology.pp != 1 or topology.dynamic or topology.dp < 2 or uneven(topology):
        return packed
    dp, m, cap = topology.dp, topology.micro_batches, topology.micro_batch_tokens
    excess_parts: list[np.ndarray] = []
    piece_parts: list[np.ndarray] = []
    step_parts: list[np.ndarray] = []
    for p, (units, sizes) in enumerate(packed):
        if len(sizes):
            e = _step_excess(u_cost[units], sizes, dp, m)
            hit = np.flatnonzero(e > 0)
            excess_parts.append(e[hit])
            piece_parts.append(np.full(len(hit), p))
            step_parts.append(hit)
    if not excess_parts:
        return packed
    excess, piece, step = np.concatenate(excess_parts), np.concatenate(piece_parts), np.concatenate(step_parts)
    keep = max(MIN_STEPS, int(sum(len(sz) for _, sz in packed) * MAX_STEPS_SHARE))
    chosen = np.lexsort((step, piece, -excess))[:keep]  # furthest above the bound first, ties by position
    out, budget, starts = list(packed), [ROUND_BUDGET], {}
    # moves and swaps first; then, with the budget left, trades for shorter units on the steps they left stuck
    # (a trade makes room where nothing else fits: it must not take the budget the other steps' moves need)
    todo = list(zip(piece[chosen].tolist(), step[chosen].tolist()))
    for trade in (False, True):
        stuck = []
        for p, s in todo:
            if budget[0] <= 0:
                break
            if p not in starts:
                out[p] = (packed[p][0].copy(), packed[p][1].copy())
                starts[p] = np.concatenate([[0], np.cumsum(out[p][1].sum(axis=1))])
            units, sizes = out[p]
            seg = slice(starts[p][s], starts[p][s + 1])
            units[seg], sizes[s], left = _refine_step(units[seg], sizes[s], u_cost, u_tok, dp, m, cap, budget, trade)
            if left:
                stuck.append((p, s))
        todo = stuck
    return out


def _step_excess(cost: np.ndarray, sizes: np.ndarray, dp: int, m: int) -> np.ndarray:
    """Per step of a piece: the slowest replica's time minus the step's bound where above (1 + TOLERANCE) x bound,
    else 0 (all steps at once)."""
    steps = len(sizes)
    per_rep = sizes.reshape(steps, dp, m).sum(axis=2).ravel()
    rep_id = np.repeat(np.arange(steps * dp), per_rep)
    times = np.bincount(rep_id, weights=cost, minlength=steps * dp).reshape(steps, dp)
    counts = sizes.sum(axis=1)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    heaviest = np.maximum.reduceat(cost, starts)
    bound = np.maximum(times.sum(axis=1) / dp, heaviest)
    worst = times.max(axis=1)
    return np.where(worst > (1 + TOLERANCE) * bound, worst - bound, 0.0)


def _refine_step(units, sizes, u_cost, u_tok, dp: int, m: int, cap: int, budget: list, trade: bool = False):
    """One step: best-improvement moves and swaps off the slowest replica (with `trade`, also trades for shorter
    units), each counted off `budget[0]`; (units re-sorted by micro-batch, their counts, whether the search stopped
    with nothing left to change)."""
    mb = np.repeat(np.arange(dp * m), sizes)
    cost, tok = u_cost[units].astype(np.float64), u_tok[units].astype(np.int64)
    if not trade and len(units) <= SMALL_STEP:  # the same search on lists (refine_small)
        small = SmallState(mb, cost, tok, dp, m)
        stuck = _search(lambda: improve_small(small, cap), budget)
        mb = np.array(small.mb, dtype=np.int64)
    else:
        state = _State(mb, cost, tok, dp, m)
        stuck = _search(lambda: _improve(state, cap, trade), budget)
        mb = state.mb
    order = np.argsort(mb, kind="stable")
    return units[order], np.bincount(mb, minlength=dp * m), stuck


def _search(improve, budget: list) -> bool:
    """Rounds of `improve()` (up to MAX_ROUNDS, each counted off `budget[0]`); whether one found nothing to
    change."""
    for _ in range(min(MAX_ROUNDS, budget[0])):
        budget[0] -= 1
        if not improve():
            return True
    return False


class _State:
    """A step's assignment (micro-batch per unit) with its replica times, micro-batch tokens and unit counts,
    updated in place by each move or swap."""

    def __init__(self, mb, cost, tok, dp: int, m: int) -> None:
        self.mb, self.cost, self.tok, self.dp, self.m = mb, cost, tok, dp, m
        self.rep = mb // m  # each unit's replica
        self.times = np.bincount(self.rep, weights=cost, minlength=dp)
        self.mb_tok = np.bincount(mb, weights=tok, minlength=dp * m).astype(np.int64)
        self.mb_n = np.bincount(mb, minlength=dp * m)

    def put(self, unit: int, to: int) -> None:
        frm, m = self.mb[unit], self.m
        self.times[frm // m] -= self.cost[unit]
        self.times[to // m] += self.cost[unit]
        self.mb_tok[frm] -= self.tok[unit]
        self.mb_tok[to] += self.tok[unit]
        self.mb_n[frm] -= 1
        self.mb_n[to] += 1
        self.mb[unit] = to
        self.rep[unit] = to // m


def _improve(st: _State, cap: int, trade: bool = False) -> bool:
    """Apply the single move or swap off the slowest replica that lowers the step time most (ties: the one that
    leaves the two replicas it changes lowest, so that of several replicas tied at the top one comes down and the
    next round lowers the next); False if none lowers the slowest replica without raising the step time. Each
    change lowers the sorted replica times lexicographically, so the search ends. With `trade`, when no move or
    single swap fits (the other replicas token-full), a unit is traded for the shortest units of a micro-batch
    elsewhere that free its tokens (`_trade_for_shorter`: attention is quadratic, so they cost less)."""
    times = st.times
    hi = int(np.argmax(times))
    now = float(times[hi])
    others = times.copy()
    others[hi] = -np.inf
    rest = float(others.max())  # dp >= 2
    a = np.flatnonzero(st.rep == hi)
    best = None
    for found in (_best_move(st, a, hi, now, rest, cap), _best_swap(st, a, hi, now, rest, cap)):
        if found is not None and (best is None or found[:2] < best[:2]):
            best = found
    if best is None and trade:
        best = _trade_for_shorter(st, a, hi, now, rest, cap)
    if best is None:
        return False
    for unit, to in best[2]:
        st.put(unit, to)
    return True


def _better(new: np.ndarray, pair: np.ndarray, now: float):
    """The cell of least step time `new` (ties: least `pair`, the larger new time of the two replicas changed),
    as (new, pair, cell), or None when no cell lowers the slowest replica (`pair` < now) without raising the step
    time."""
    ok = (pair < now * (1 - 1e-12)) & (new <= now)
    if not ok.any():
        return None
    new, pair = np.where(ok, new, np.inf), np.where(ok, pair, np.inf)
    cells = np.flatnonzero(new.ravel() <= new.min())
    cell = int(cells[np.argmin(pair.ravel()[cells])])
    return float(new.ravel()[cell]), float(pair.ravel()[cell]), np.unravel_index(cell, new.shape)


def _best_move(st: _State, a: np.ndarray, hi: int, now: float, rest: float, cap: int):
    """Unit a -> the roomiest micro-batch of another replica (a's micro-batch keeps a unit). A move's new time and
    pair time only grow with the receiving replica's time, so each unit's best replica is the fastest one with room
    for it (one search over the replicas sorted by time, not a unit x replica table); the chosen unit's row is then
    scanned whole, so ties go to the lowest replica as in a full table."""
    dp, m, times, cost = st.dp, st.m, st.times, st.cost
    room = cap - st.mb_tok.reshape(dp, m)
    target = np.argmax(room, axis=1)
    widest = room[np.arange(dp), target]
    movable = a[st.mb_n[st.mb[a]] > 1]
    if not len(movable):
        return None
    by_time = np.argsort(times, kind="stable")
    by_time = by_time[by_time != hi]
    reach = np.maximum.accumulate(widest[by_time])  # the widest room among the fastest k replicas
    k = np.searchsorted(reach, st.tok[movable])  # the first (fastest) replica with room for each unit
    c = cost[movable]
    fastest = times[by_time[np.minimum(k, len(by_time) - 1)]]
    pair = np.where(k < len(by_time), np.maximum(now - c, fastest + c), np.inf)
    found = _better(np.maximum(rest, pair), pair, now)
    if found is None:
        return None
    i = int(found[2][0])
    fits = st.tok[movable[i]] <= widest
    fits[hi] = False
    row = np.where(fits, np.maximum(now - c[i], times + c[i]), np.inf)
    r = int(np.flatnonzero((np.maximum(rest, row) <= found[0]) & (row <= found[1]))[0])
    return found[0], found[1], [(int(movable[i]), int(r * m + target[r]))]


def _best_swap(st: _State, a: np.ndarray, hi: int, now: float, rest: float, cap: int):
    """Swaps with the fastest replica: a <-> b lowering hi by cost[a] - cost[b] in (0, gap); for each a, the b
    nearest to the ideal cost[a] - gap / 2 (either side) is tried."""
    mb, cost, tok, times, mb_tok = st.mb, st.cost, st.tok, st.times, st.mb_tok
    lo = int(np.argmin(times))
    b = np.flatnonzero(st.rep == lo)
    if not len(a) or not len(b) or lo == hi:
        return None
    b = b[np.argsort(cost[b], kind="stable")]
    at = np.searchsorted(cost[b], cost[a] - (now - times[lo]) / 2)
    # both neighbours of the ideal at once: [the one at or above it for every a, then the one below]
    a2 = np.concatenate([a, a])
    bj = b[np.concatenate([np.minimum(at, len(b) - 1), np.maximum(at - 1, 0)])]
    delta = cost[a2] - cost[bj]
    ok = (delta > 0) & (mb_tok[mb[a2]] - tok[a2] + tok[bj] <= cap) & (mb_tok[mb[bj]] - tok[bj] + tok[a2] <= cap)
    pair = np.where(ok, np.maximum(now - delta, times[lo] + delta), np.inf)
    found = _better(np.maximum(rest, pair), pair, now)
    if found is None:
        return None
    i = int(found[2][0])
    return found[0], found[1], [(int(a2[i]), int(mb[bj[i]])), (int(bj[i]), int(mb[a2[i]]))]


def _trade_for_shorter(st: _State, a: np.ndarray, hi: int, now: float, rest: float, cap: int):
    """Unit x of the slowest replica -> micro-batch j of another replica, and the shortest units of j that free
    the tokens x needs there -> x's micro-batch (all of them fitting in its room). With cost convex in tokens the
    short units cost less than x: the slowest replica sheds the difference. Every (x, j) pair at once: j's units
    sorted by tokens, the fewest whose running sum covers the need found by one search over the running sums."""
    mb, cost, tok, times, mb_tok, m = st.mb, st.cost, st.tok, st.times, st.mb_tok, st.m
    nb = st.dp * m
    if not len(a):
        return None
    order = np.lexsort((np.arange(len(mb)), tok, mb))  # by micro-batch, shortest first
    run_tok, run_cost = np.cumsum(tok[order]), np.cumsum(cost[order])
    end = np.cumsum(st.mb_n)
    start = end - st.mb_n
    base_tok = np.where(start > 0, run_tok[np.maximum(start - 1, 0)], 0)
    base_cost = np.where(start > 0, run_cost[np.maximum(start - 1, 0)], 0.0)
    need = mb_tok[None, :] + tok[a][:, None] - cap  # [A, nb] tokens j must free to take x
    at = np.searchsorted(run_tok, base_tok[None, :] + need)  # j's last unit to leave
    ok = (need > 0) & (at < end[None, :]) & (np.arange(nb) // m != hi)[None, :]
    last = np.minimum(at, len(order) - 1)
    freed = run_tok[last] - base_tok[None, :]
    shed = cost[a][:, None] - (run_cost[last] - base_cost[None, :])  # what the slowest replica sheds
    ok &= (shed > 0) & (mb_tok[mb[a]][:, None] - tok[a][:, None] + freed <= cap)
    pair = np.where(ok, np.maximum(now - shed, times[np.arange(nb) // m][None, :] + shed), np.inf)
    found = _better(np.maximum(rest, pair), pair, now)
    if found is None:
        return None
    i, j = (int(x) for x in found[2])
    x, home = int(a[i]), int(mb[a[i]])
    return found[0], found[1], [(x, j)] + [(int(u), home) for u in order[start[j] : last[i, j] + 1]]
