"""Replica refinement of packed steps (cp = pp = 1 ... any static CP, pp = 1): a replica's step time is the sum of
its micro-batches, so only which replica holds a unit matters, not which of its micro-batches. For the steps furthest
above their bound, move or swap units from the slowest replica to others while every micro-batch stays within
`max_tokens * cp` and non-empty, taking each time the move or swap that lowers the step time most."""

from __future__ import annotations

import numpy as np

from balancer.planning.speeds import uneven
from balancer.planning.topology import Topology

TOLERANCE = 0.002  # a step within 0.2% of its bound is left as it is
MAX_STEPS_SHARE = 1 / 32  # at most this share of the steps (the furthest above their bound; at least MIN_STEPS)
MIN_STEPS = 64
MAX_ROUNDS = 48  # moves or swaps per step
ROUND_BUDGET = 1024  # moves or swaps per epoch (or window), steps taken furthest above their bound first


def refine_packed(packed: list, u_cost: np.ndarray, u_tok: np.ndarray, topology: Topology) -> list:
    """`packed`: pieces (units sorted by step and micro-batch, [steps, micro-batches] sizes) as the settle pass
    returns them; the same pieces with units moved between replicas where that lowers a step's time. Deterministic;
    a no-op for pp > 1 (a pipeline's time also depends on its largest micro-batch), dynamic CP and uneven rank
    speeds (its moves compare unweighted replica times, which would undo the speed-proportional shares)."""
    if topology.pp != 1 or topology.dynamic or topology.dp < 2 or uneven(topology):
        return packed
    dp, m, cap = topology.dp, topology.micro_batches, topology.micro_batch_tokens
    excess, piece, step = [], [], []
    for p, (units, sizes) in enumerate(packed):
        if len(sizes):
            e = _step_excess(u_cost[units], sizes, dp, m)
            hit = np.flatnonzero(e > 0)
            excess.append(e[hit])
            piece.append(np.full(len(hit), p))
            step.append(hit)
    if not excess:
        return packed
    excess, piece, step = np.concatenate(excess), np.concatenate(piece), np.concatenate(step)
    keep = max(MIN_STEPS, int(sum(len(sz) for _, sz in packed) * MAX_STEPS_SHARE))
    chosen = np.lexsort((step, piece, -excess))[:keep]  # furthest above the bound first, ties by position
    out, budget, starts = list(packed), [ROUND_BUDGET], {}
    for p, s in zip(piece[chosen].tolist(), step[chosen].tolist()):
        if budget[0] <= 0:
            break
        if p not in starts:
            out[p] = (packed[p][0].copy(), packed[p][1].copy())
            starts[p] = np.concatenate([[0], np.cumsum(out[p][1].sum(axis=1))])
        units, sizes = out[p]
        seg = slice(starts[p][s], starts[p][s + 1])
        units[seg], sizes[s] = _refine_step(units[seg], sizes[s], u_cost, u_tok, dp, m, cap, budget)
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


def _refine_step(units, sizes, u_cost, u_tok, dp: int, m: int, cap: int, budget: list):
    """One step: best-improvement moves and swaps off the slowest replica (each counted off `budget[0]`); units
    re-sorted by micro-batch."""
    mb = np.repeat(np.arange(dp * m), sizes)
    cost, tok = u_cost[units].astype(np.float64), u_tok[units].astype(np.int64)
    state = _State(mb, cost, tok, dp, m)
    for _ in range(min(MAX_ROUNDS, budget[0])):
        budget[0] -= 1
        if not _improve(state, cap):
            break
    order = np.argsort(state.mb, kind="stable")
    return units[order], np.bincount(state.mb, minlength=dp * m)


class _State:
    """A step's assignment (micro-batch per unit) with its replica times, micro-batch tokens and unit counts,
    updated in place by each move or swap."""

    def __init__(self, mb, cost, tok, dp: int, m: int) -> None:
        self.mb, self.cost, self.tok, self.dp, self.m = mb, cost, tok, dp, m
        self.times = np.bincount(mb // m, weights=cost, minlength=dp)
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


def _improve(st: _State, cap: int) -> bool:
    """Apply the single move or swap off the slowest replica that lowers the step time most; False if none does."""
    mb, cost, tok, times, mb_tok, dp, m = st.mb, st.cost, st.tok, st.times, st.mb_tok, st.dp, st.m
    rep = mb // m
    hi = int(np.argmax(times))
    now = times[hi]
    rest = np.max(np.delete(times, hi))
    a = np.flatnonzero(rep == hi)
    best, action = now * (1 - 1e-12), None
    # moves: unit a -> the roomiest micro-batch of another replica (a's micro-batch keeps a unit)
    room = cap - mb_tok.reshape(dp, m)
    target = np.argmax(room, axis=1)
    movable = a[st.mb_n[mb[a]] > 1]
    if len(movable):
        fits = tok[movable][:, None] <= room[np.arange(dp), target][None, :]
        fits[:, hi] = False
        new = np.maximum(np.maximum(rest, now - cost[movable])[:, None], times[None, :] + cost[movable][:, None])
        new = np.where(fits, new, np.inf)
        i, r = np.unravel_index(int(np.argmin(new)), new.shape)
        if new[i, r] < best:
            best, action = new[i, r], ("move", movable[i], r * m + target[r])
    # swaps with the fastest replica: a <-> b lowering hi by cost[a] - cost[b] in (0, gap); for each a, the b
    # nearest to the ideal cost[a] - gap / 2 (either side) is tried
    lo = int(np.argmin(times))
    b = np.flatnonzero(rep == lo)
    if len(a) and len(b) and lo != hi:
        b = b[np.argsort(cost[b], kind="stable")]
        want = cost[a] - (now - times[lo]) / 2
        at = np.searchsorted(cost[b], want)
        for j in (np.clip(at, 0, len(b) - 1), np.clip(at - 1, 0, len(b) - 1)):
            bj = b[j]
            delta = cost[a] - cost[bj]
            ok = (delta > 0) & (mb_tok[mb[a]] - tok[a] + tok[bj] <= cap) & (mb_tok[mb[bj]] - tok[bj] + tok[a] <= cap)
            new = np.where(ok, np.maximum(rest, np.maximum(now - delta, times[lo] + delta)), np.inf)
            i = int(np.argmin(new))
            if new[i] < best:
                best, action = new[i], ("swap", a[i], bj[i])
    if action is None:
        return False
    if action[0] == "move":
        st.put(action[1], action[2])
    else:
        x, y = action[1], action[2]
        mx, my = mb[x], mb[y]
        st.put(x, my)
        st.put(y, mx)
    return True
