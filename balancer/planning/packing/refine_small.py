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


def _better(cells, now: float):
    """Of (new, pair, change) cells in order, the first of least (new, pair) that lowers the slowest replica
    (`pair` < now) without raising the step time (`refine._better`); None if no cell does."""
    limit = now * (1 - 1e-12)
    best = None
    for cell in cells:
        if cell[1] < limit and cell[0] <= now and (best is None or cell[:2] < best[:2]):
            best = cell
    return best


def _best_move(st: SmallState, a: list, hi: int, now: float, rest: float, cap: int):
    """`refine._best_move`: a unit of the slowest replica to the roomiest micro-batch of the fastest replica with
    room for it, then the lowest replica that does as well."""
    dp, m, times, cost, tok = st.dp, st.m, st.times, st.cost, st.tok
    movable = [u for u in a if st.mb_n[st.mb[u]] > 1]
    if not movable:
        return None
    room = [cap - t for t in st.mb_tok]
    widest = [max(room[r * m : r * m + m]) for r in range(dp)]
    by_time = [r for r in sorted(range(dp), key=times.__getitem__) if r != hi]
    reach, top = [], -INF
    for r in by_time:
        top = max(top, widest[r])
        reach.append(top)
    cells = []
    for u in movable:
        k = bisect_left(reach, tok[u])
        if k < len(by_time):
            pair = max(now - cost[u], times[by_time[k]] + cost[u])
            cells.append((max(rest, pair), pair, u))
    found = _better(cells, now)
    if found is None:
        return None
    new, pair, u = found
    for r in range(dp):
        if r != hi and tok[u] <= widest[r]:
            row = max(now - cost[u], times[r] + cost[u])
            if max(rest, row) <= new and row <= pair:
                seg = room[r * m : r * m + m]
                return new, pair, [(u, r * m + seg.index(widest[r]))]
    raise AssertionError("the chosen move has a replica")  # the fastest replica with room is one


def _best_swap(st: SmallState, a: list, hi: int, now: float, rest: float, cap: int):
    """`refine._best_swap`: a <-> b with the fastest replica, for each a the b nearest the ideal cost (either
    side), lowering the slowest replica by the difference."""
    mb, cost, tok, times, mb_tok = st.mb, st.cost, st.tok, st.times, st.mb_tok
    lo = times.index(min(times))
    b = [u for u, r in enumerate(st.rep) if r == lo]
    if not a or not b or lo == hi:
        return None
    b.sort(key=cost.__getitem__)
    b_cost = [cost[u] for u in b]
    half, fastest = (now - times[lo]) / 2, times[lo]
    at = [bisect_left(b_cost, cost[u] - half) for u in a]
    pairs = [(u, b[min(k, len(b) - 1)]) for u, k in zip(a, at)] + [(u, b[max(k - 1, 0)]) for u, k in zip(a, at)]
    cells = []
    for u, v in pairs:
        delta = cost[u] - cost[v]
        if delta > 0 and mb_tok[mb[u]] - tok[u] + tok[v] <= cap and mb_tok[mb[v]] - tok[v] + tok[u] <= cap:
            pair = max(now - delta, fastest + delta)
            cells.append((max(rest, pair), pair, (u, v)))
    found = _better(cells, now)
    if found is None:
        return None
    u, v = found[2]
    return found[0], found[1], [(u, mb[v]), (v, mb[u])]
