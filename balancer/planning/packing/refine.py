"""Replica refinement of packed steps (cp = pp = 1 ... any static CP, pp = 1): a replica's step time is the sum of
its micro-batches, so only which replica holds a unit matters, not which of its micro-batches. For the steps furthest
above their bound, move or swap units from the slowest replica to others while every micro-batch stays within
`max_tokens * cp` and non-empty, taking each time the move or swap that lowers the step time most."""

from __future__ import annotations

import numpy as np

from balancer.planning.topology import Topology

TOLERANCE = 0.002  # a step within 0.2% of its bound is left as it is
MAX_STEPS_SHARE = 1 / 8  # at most this share of the steps (the furthest above their bound; at least MIN_STEPS)
MIN_STEPS = 64
MAX_ROUNDS = 48  # moves or swaps per step


def refine_packed(packed: list, u_cost: np.ndarray, u_tok: np.ndarray, topology: Topology) -> list:
    """`packed`: pieces (units sorted by step and micro-batch, [steps, micro-batches] sizes) as the settle pass
    returns them; the same pieces with units moved between replicas where that lowers a step's time. Deterministic;
    a no-op for pp > 1 (a pipeline's time also depends on its largest micro-batch) and dynamic CP."""
    if topology.pp != 1 or topology.dynamic or topology.dp < 2:
        return packed
    dp, m, cap = topology.dp, topology.micro_batches, topology.micro_batch_tokens
    candidates = []
    for p, (units, sizes) in enumerate(packed):
        starts = np.concatenate([[0], np.cumsum(sizes.sum(axis=1))])
        for s in range(len(sizes)):
            cost = u_cost[units[starts[s] : starts[s + 1]]]
            rep = np.repeat(np.arange(dp), sizes[s].reshape(dp, m).sum(axis=1))
            times = np.bincount(rep, weights=cost, minlength=dp)
            bound = max(cost.sum() / dp, cost.max())
            if times.max() > (1 + TOLERANCE) * bound:
                candidates.append((times.max() - bound, p, s))
    steps = sum(len(sz) for _, sz in packed)
    keep = max(MIN_STEPS, int(steps * MAX_STEPS_SHARE))
    chosen = sorted(candidates, key=lambda c: (-c[0], c[1], c[2]))[:keep]
    by_piece: dict[int, list[int]] = {}
    for _, p, s in chosen:
        by_piece.setdefault(p, []).append(s)
    out = list(packed)
    for p, step_ids in by_piece.items():
        units, sizes = packed[p]
        units, sizes = units.copy(), sizes.copy()
        starts = np.concatenate([[0], np.cumsum(sizes.sum(axis=1))])
        for s in step_ids:
            seg = slice(starts[s], starts[s + 1])
            units[seg], sizes[s] = _refine_step(units[seg], sizes[s], u_cost, u_tok, dp, m, cap)
        out[p] = (units, sizes)
    return out


def _refine_step(units, sizes, u_cost, u_tok, dp: int, m: int, cap: int):
    """One step: best-improvement moves and swaps off the slowest replica; units re-sorted by micro-batch."""
    mb = np.repeat(np.arange(dp * m), sizes)
    cost, tok = u_cost[units].astype(np.float64), u_tok[units].astype(np.int64)
    for _ in range(MAX_ROUNDS):
        if not _improve(mb, cost, tok, dp, m, cap):
            break
    order = np.argsort(mb, kind="stable")
    return units[order], np.bincount(mb, minlength=dp * m)


def _improve(mb: np.ndarray, cost: np.ndarray, tok: np.ndarray, dp: int, m: int, cap: int) -> bool:
    """Apply the single move or swap off the slowest replica that lowers the step time most; False if none does."""
    rep = mb // m
    times = np.bincount(rep, weights=cost, minlength=dp)
    mb_tok = np.bincount(mb, weights=tok, minlength=dp * m).astype(np.int64)
    mb_n = np.bincount(mb, minlength=dp * m)
    hi = int(np.argmax(times))
    now = times[hi]
    rest = np.max(np.delete(times, hi))
    a = np.flatnonzero(rep == hi)
    best, action = now * (1 - 1e-12), None
    # moves: unit a -> the roomiest micro-batch of another replica (a's micro-batch keeps a unit)
    room = cap - mb_tok.reshape(dp, m)
    target = np.argmax(room, axis=1)
    movable = a[mb_n[mb[a]] > 1]
    if len(movable):
        fits = tok[movable][:, None] <= room[np.arange(dp), target][None, :]
        fits[:, hi] = False
        new = np.maximum(np.maximum(rest, now - cost[movable])[:, None], times[None, :] + cost[movable][:, None])
        new = np.where(fits, new, np.inf)
        i, r = np.unravel_index(int(np.argmin(new)), new.shape)
        if new[i, r] < best:
            best, action = new[i, r], ("move", movable[i], r * m + target[r])
    # swaps with the fastest replica: a <-> b lowering hi by cost[a] - cost[b] > 0, both micro-batches within cap
    lo = int(np.argmin(times))
    b = np.flatnonzero(rep == lo)
    if len(a) and len(b) and lo != hi:
        delta = cost[a][:, None] - cost[b][None, :]
        ok = (delta > 0) & (mb_tok[mb[a]][:, None] - tok[a][:, None] + tok[b][None, :] <= cap)
        ok &= mb_tok[mb[b]][None, :] - tok[b][None, :] + tok[a][:, None] <= cap
        new = np.where(ok, np.maximum(rest, np.maximum(now - delta, times[lo] + delta)), np.inf)
        i, j = np.unravel_index(int(np.argmin(new)), new.shape)
        if new[i, j] < best:
            best, action = new[i, j], ("swap", a[i], b[j])
    if action is None:
        return False
    if action[0] == "move":
        mb[action[1]] = action[2]
    else:
        mb[action[1]], mb[action[2]] = mb[action[2]], mb[action[1]]
    return True
