"""The replica refinement's search (balancer.planning.packing.refine) on Python lists, for small steps: a step of a
few dozen units spends its rounds in NumPy's per-call overhead (some 40 calls a round on arrays of a few elements),
so there the same moves and swaps are found by plain loops. Every comparison is the NumPy search's, on the same
float64 values in the same order (ties go the same way), so both find the same change each round; the trades for
shorter units (`refine._trade_for_shorter`) stay with the NumPy search."""

from __future__ import annotations

from bisect import bisect_left

import numpy as np

INF = float("inf")


class SmallState:
    """A step's assignment on lists: each unit's micro-batch and replica, the replicas' times, the micro-batches'
    tokens and unit counts (as `refine._State`, whose bincounts give the starting values)."""

    def __init__(self, mb: np.ndarray, cost: np.ndarray, tok: np.ndarray, dp: int, m: int) -> None:
        self.dp, self.m = dp, m
        self.mb, self.rep = mb.tolist(), (mb // m).tolist()
        self.cost, self.tok = cost.tolist(), tok.tolist()
        self.times = np.bincount(mb // m, weights=cost, minlength=dp).tolist()
        self.mb_tok = np.bincount(mb, weights=tok, minlength=dp * m).astype(np.int64).tolist()
        self.mb_n = np.bincount(mb, minlength=dp * m).tolist()

    def put(self, unit: int, to: int) -> None:
        frm, m, c, t = self.mb[unit], self.m, self.cost[unit], self.tok[unit]
        self.times[frm // m] -= c
        self.times[to // m] += c
        self.mb_tok[frm] -= t
        self.mb_tok[to] += t
        self.mb_n[frm] -= 1
        self.mb_n[to] += 1
        self.mb[unit] = to
        self.rep[unit] = to // m


def improve_small(st: SmallState, cap: int) -> bool:
    """`refine._improve` without trades: apply the move or swap off the slowest replica that lowers the step time
    most (ties: the one leaving the two replicas it changes lowest, then the first found); False if none does."""
    times = st.times
    now = max(times)
    hi = times.index(now)
    rest = max(t for r, t in enumerate(times) if r != hi)
    a = [u for u, r in enumerate(st.rep) if r == hi]
    best = None
    for found in (_best_move(st, a, hi, now, rest, cap), _best_swap(st, a, hi, now, rest, cap)):
        if found is not None and (best is None or found[:2] < best[:2]):
            best = found
    if best is None:
        return False
    for unit, to in best[2]:
        st.put(unit, to)
    return True


def _best_move(st: SmallState, a: list, hi: int, now: float, rest: float, cap: int):
    """`refine._best_move`: a unit of the slowest replica to the roomiest micro-batch of the fastest replica with
    room for it, then the lowest replica that does as well. Of the units in order, the first of least (new step
    time, pair time) that lowers the slowest replica without raising the step time (`refine._better`)."""
    dp, m, times, cost, tok, mb, mb_n = st.dp, st.m, st.times, st.cost, st.tok, st.mb, st.mb_n
    room = [cap - t for t in st.mb_tok]
    widest = [max(room[r * m : r * m + m]) for r in range(dp)]
    by_time = [r for r in sorted(range(dp), key=times.__getitem__) if r != hi]
    reach, top = [], -INF
    for r in by_time:
        top = max(top, widest[r])
        reach.append(top)
    limit, count, best, best_new, best_pair = now * (1 - 1e-12), len(by_time), None, INF, INF
    for u in a:
        if mb_n[mb[u]] <= 1:
            continue
        k = bisect_left(reach, tok[u])
        if k < count:
            c = cost[u]
            down, up = now - c, times[by_time[k]] + c
            pair = down if down >= up else up  # max(), inline: the loop runs a few hundred times a round
            new = rest if rest >= pair else pair
            if pair < limit and new <= now and (new < best_new or (new == best_new and pair < best_pair)):
                best, best_new, best_pair = u, new, pair
    if best is None:
        return None
    new, pair, u = best_new, best_pair, best
    for r in range(dp):
        if r != hi and tok[u] <= widest[r]:
            row = max(now - cost[u], times[r] + cost[u])
            if max(rest, row) <= new and row <= pair:
                seg = room[r * m : r * m + m]
                return new, pair, [(u, r * m + seg.index(widest[r]))]
    raise AssertionError("the chosen move has a replica")  # the fastest replica with room is one


def _best_swap(st: SmallState, a: list, hi: int, now: float, rest: float, cap: int):
    """`refine._best_swap`: a <-> b with the fastest replica, for each a the b nearest the ideal cost (the one at
    or above it for every a, then the one below), lowering the slowest replica by the difference; the first of
    least (new step time, pair time) as `refine._better` takes it."""
    mb, cost, tok, times, mb_tok = st.mb, st.cost, st.tok, st.times, st.mb_tok
    lo = times.index(min(times))
    b = [u for u, r in enumerate(st.rep) if r == lo]
    if not a or not b or lo == hi:
        return None
    b.sort(key=cost.__getitem__)
    b_cost = [cost[u] for u in b]
    half, fastest, last = (now - times[lo]) / 2, times[lo], len(b) - 1
    at = [bisect_left(b_cost, cost[u] - half) for u in a]
    limit, best, best_new, best_pair = now * (1 - 1e-12), None, INF, INF
    for partner in ([b[min(k, last)] for k in at], [b[max(k - 1, 0)] for k in at]):
        for u, v in zip(a, partner):
            delta = cost[u] - cost[v]
            if delta <= 0:
                continue
            down, up = now - delta, fastest + delta
            pair = down if down >= up else up  # max(), inline: the loop runs a few hundred times a round
            new = rest if rest >= pair else pair
            if (
                pair < limit
                and new <= now
                and (new < best_new or (new == best_new and pair < best_pair))
                and mb_tok[mb[u]] - tok[u] + tok[v] <= cap
                and mb_tok[mb[v]] - tok[v] + tok[u] <= cap
            ):
                best, best_new, best_pair = (u, v), new, pair
    if best is None:
        return None
    u, v = best
    return best_new, best_pair, [(u, mb[v]), (v, mb[u])]
