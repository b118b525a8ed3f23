"""Moving small units across steps (pp = 1, static CP, even ranks): a step waits for its slowest replica, and the
other replicas of most steps finish a little earlier. A unit of a step's slowest replica moved to a replica of a
nearby step that finishes early enough to take it without becoming that step's slowest lowers the first step's time
and leaves the other's as it is: the epoch gets shorter by the first step's gain, never longer. Granular steps (one
or two documents per micro-batch, where no packing of the step's own documents reaches its bound) gain most.

Every move keeps each micro-batch within `max_tokens * cp` and non-empty, and both steps within STEP_ROOM of
`tokens_per_step` (the last step is left alone: it may be smaller); a unit moves at most WINDOW steps at a time
and ends at most DRIFT steps from the step it was packed in, so its delay stays small. Steps are taken furthest
above their mean replica time first, and a budget of moves per epoch (`move_budget`) bounds the work: small epochs
are refined through, large ones (1M documents) skip the pass and keep their planning time. A move looks only at
the units packed within DRIFT steps (a slice of the epoch's units) and keeps each step's time up to date,
so its cost does not grow with the epoch.
"""

from __future__ import annotations

import heapq

import numpy as np

from balancer.planning.speeds import uneven
from balancer.planning.topology import Topology

WINDOW = 4  # a unit moves to a step at most this many steps away ...
DRIFT = 8  # ... and ends at most this many steps from the step it was packed in
MAX_MINE, MAX_THEIRS = 32, 512  # units of the slowest replica and partners looked at per move (spread by cost)
STEP_ROOM = 0.09  # steps stay within this share of tokens_per_step (the planner's rule is 10%)
TOLERANCE = 1e-4  # a step within this share of its mean replica time is left as it is
MOVES_PER_REPLICA = 2  # epochs (or windows) of at most FULL_UNITS units get this many moves per step and replica;
FULL_UNITS = 50_000  # larger ones none: a move costs ~0.5-1 ms, which 1M documents' ~17K steps cannot afford


def move_budget(units: int, steps: int, dp: int) -> int:
    """Moves per epoch: MOVES_PER_REPLICA * dp per step for epochs of at most FULL_UNITS units, else 0."""
    return MOVES_PER_REPLICA * dp * steps if units <= FULL_UNITS else 0


def move_across(packed: list, u_cost: np.ndarray, u_tok: np.ndarray, topology: Topology) -> list:
    """`packed`: pieces (units sorted by step and micro-batch, [steps, micro-batches] sizes) as the settle pass
    returns them; the epoch as one piece with units moved across steps where that lowers the epoch's time (module
    docstring). Deterministic. A no-op for pp > 1, dynamic CP, uneven rank speeds, dp = 1 and fewer than 3 steps."""
    t = topology
    steps = sum(len(sz) for _, sz in packed)
    if t.pp != 1 or t.dynamic or t.dp < 2 or uneven(t) or steps < 3 or t.tokens_per_step is None:
        return packed
    budget = move_budget(sum(len(u) for u, _ in packed), steps, t.dp)
    if budget == 0:
        return packed
    units = np.concatenate([u for u, _ in packed])
    sizes = np.concatenate([sz for _, sz in packed])  # [steps, nb]
    nb = t.bins_per_step
    mb = np.repeat(np.arange(steps * nb), sizes.ravel())  # flat micro-batch (step * nb + bin) of every unit
    state = _Epoch(mb, u_cost[units].astype(np.float64), u_tok[units].astype(np.int64), steps, t.dp, t.micro_batches)
    lo, hi = (1 - STEP_ROOM) * t.tokens_per_step, (1 + STEP_ROOM) * t.tokens_per_step
    heap = [(-e, s) for s, e in enumerate(state.excess().tolist()) if e > 0 and s < steps - 1]
    heapq.heapify(heap)
    while heap and budget > 0:
        _, s = heapq.heappop(heap)
        if _move_one(state, s, t.micro_batch_tokens, lo, hi):
            budget -= 1
            e = state.step_excess(s)
            if e > 0:
                heapq.heappush(heap, (-e, s))
    order = np.lexsort((units, state.mb))  # by step and micro-batch, shuffled order inside
    return [(units[order], np.bincount(state.mb, minlength=steps * nb).reshape(steps, nb))]


class _Epoch:
    """Every unit's flat micro-batch and the per-micro-batch, per-replica and per-step sums, updated by each move.
    Units are indexed by their position in the epoch as packed (sorted by step), so the units that started in a
    range of steps are a slice (`start`); a unit ends at most DRIFT steps from the step it started in (`home`)."""

    def __init__(self, mb, cost, tok, steps: int, dp: int, m: int) -> None:
        self.mb, self.cost, self.tok, self.dp, self.m, self.nb = mb, cost, tok, dp, m, dp * m
        self.rep = mb // m  # each unit's flat replica (step * dp + replica)
        self.home = mb // self.nb
        self.start = np.searchsorted(self.home, np.arange(steps + 1))
        self.load = np.bincount(mb // m, weights=cost, minlength=steps * dp).reshape(steps, dp)
        self.flat_load = self.load.reshape(-1)  # by flat replica (step * dp + replica = micro-batch // m)
        self.top = self.load.max(axis=1)  # each step's time
        self.bin_tok = np.bincount(mb, weights=tok, minlength=steps * self.nb).astype(np.int64)
        self.bin_n = np.bincount(mb, minlength=steps * self.nb)
        self.step_tok = self.bin_tok.reshape(steps, self.nb).sum(axis=1)

    def excess(self) -> np.ndarray:
        mean = self.load.mean(axis=1)
        return np.where(self.top > (1 + TOLERANCE) * mean, self.top - mean, 0.0)

    def step_excess(self, s: int) -> float:
        row = self.load[s].tolist()
        top, mean = max(row), sum(row) / len(row)
        return top - mean if top > (1 + TOLERANCE) * mean else 0.0

    def window(self, s: int, reach: int) -> slice:
        """The units that started within `reach` steps of step s."""
        return slice(int(self.start[max(0, s - reach)]), int(self.start[min(len(self.top), s + reach + 1)]))

    def put(self, u: int, to: int) -> None:
        frm, m, nb = int(self.mb[u]), self.m, self.nb
        c, k = float(self.cost[u]), int(self.tok[u])
        self.flat_load[frm // m] -= c
        self.flat_load[to // m] += c
        self.bin_tok[frm] -= k
        self.bin_tok[to] += k
        self.bin_n[frm] -= 1
        self.bin_n[to] += 1
        self.step_tok[frm // nb] -= k
        self.step_tok[to // nb] += k
        self.mb[u] = to
        self.rep[u] = to // m
        for q in {frm // nb, to // nb}:
            self.top[q] = max(self.load[q].tolist())


def _move_one(st: _Epoch, s: int, cap: int, lo: float, hi: float) -> bool:
    """Lower step `s`'s time by one move or swap with a nearby step: a unit of its slowest replica moves to, or
    trades places with a cheaper unit of, a replica of that step that finishes early enough to take the difference
    without becoming the step's slowest. The change that lowers step s's time most is made (ties: the one that
    leaves the receiving replica least time to spare); False when none does."""
    dp = st.dp
    row = st.load[s].tolist()
    r = row.index(max(row))
    # lowering one of several replicas tied at the top gains nothing yet, but the next move lowers the other: the
    # gain is counted down to the step's mean (a move never costs time, so an early one is never a loss)
    gap = row[r] - sum(row) / dp
    if gap <= 0:
        return False
    steps = len(st.top)
    # the units of step s, and every partner (it ends on step s after a swap, so within DRIFT of where it started),
    # started within DRIFT of s: one slice of the epoch
    win = st.window(s, DRIFT)
    w_rep = st.rep[win]
    mine = win.start + np.flatnonzero(w_rep == s * dp + r)
    if not len(mine):
        return False
    w_step = w_rep // dp
    w_slack = st.top[w_step] - st.flat_load[w_rep]  # what the partner's replica may gain without slowing
    near = np.abs(w_step - s) <= WINDOW
    near[w_step == s] = False
    near[w_step == steps - 1] = False  # never the last step
    keep = near & (w_slack > 0) & (st.cost[win] < st.cost[mine].max())
    theirs = win.start + np.flatnonzero(keep)
    mine = _spread(mine, st.cost, MAX_MINE)
    best, gain, spare = None, -np.inf, np.inf
    if len(theirs):
        theirs = _spread(theirs, st.cost, MAX_THEIRS)
        best, gain, spare = _best_swap(st, s, mine, theirs, gap, cap, lo, hi)
    move = _best_move(st, s, mine, gap, cap, lo, hi)
    if best is None and move is None:
        return False
    if move is not None and (best is None or move[0] > gain or (move[0] == gain and move[1] < spare)):
        st.put(move[2], move[3])
        return True
    assert best is not None, "without a swap the move returned above"
    a, b = best
    to_a, to_b = int(st.mb[b]), int(st.mb[a])
    st.put(a, to_a)
    st.put(b, to_b)
    return True


def _best_swap(st: _Epoch, s: int, mine: np.ndarray, theirs: np.ndarray, gap: float, cap: int, lo: float, hi: float):
    """((a, b), gain, spare) of the best swap of a unit a of `mine` with a cheaper unit b of `theirs` (b's replica
    takes the difference within its slack; both micro-batches within the cap, both steps within the token band, a
    within DRIFT steps of where it started), or (None, -inf, inf)."""
    nb, m = st.nb, st.m
    b_mb = st.mb[theirs]
    b_step = b_mb // nb
    b_slack = st.top[b_step] - st.flat_load[b_mb // m]
    # the token shift t_a - t_b moving to b's step: its bounds from b's side, then from a's
    shift_lo = np.maximum(lo - st.step_tok[b_step], st.step_tok[s] - hi)
    shift_hi = np.minimum(np.minimum(cap - st.bin_tok[b_mb], hi - st.step_tok[b_step]), st.step_tok[s] - lo)
    c_a, t_a = st.cost[mine], st.tok[mine]
    delta = c_a[:, None] - st.cost[theirs][None, :]
    shift = t_a[:, None] - st.tok[theirs][None, :]
    ok = (delta > 0) & (delta <= b_slack) & (shift >= shift_lo) & (shift <= shift_hi)
    ok &= shift >= (st.bin_tok[st.mb[mine]] - cap)[:, None]
    ok &= np.abs(b_step[None, :] - st.home[mine][:, None]) <= DRIFT
    gain = np.where(ok, np.minimum(delta, gap), -np.inf)
    cell = _best(gain, b_slack[None, :] - delta)
    if cell is None:
        return None, -np.inf, np.inf
    i, j = cell
    return (int(mine[i]), int(theirs[j])), float(gain[i, j]), float(b_slack[j] - delta[i, j])


def _spread(units: np.ndarray, cost: np.ndarray, most: int) -> np.ndarray:
    """At most `most` of `units`, spread evenly over their costs (all of them when they are few)."""
    if len(units) <= most:
        return units
    units = units[np.lexsort((units, cost[units]))]
    return units[np.linspace(0, len(units) - 1, most).astype(np.int64)]


def _best(gain: np.ndarray, spare: np.ndarray):
    """The cell of largest gain (ties: least spare time left), or None when no gain is positive."""
    top = gain.max() if gain.size else -np.inf
    if not top > 0:
        return None
    cells = np.flatnonzero(gain.ravel() >= top * (1 - 1e-12))
    return np.unravel_index(int(cells[np.argmin(spare.ravel()[cells])]), gain.shape)


def _best_move(st: _Epoch, s: int, mine: np.ndarray, gap: float, cap: int, lo: float, hi: float):
    """(gain, spare, unit, micro-batch) of the best move of a unit of `mine` into a replica of a step within
    WINDOW of s and DRIFT of where the unit started (its micro-batch: the tightest that fits), or None."""
    dp, m, nb = st.dp, st.m, st.nb
    mine = mine[(st.bin_n[st.mb[mine]] > 1) & (st.step_tok[s] - st.tok[mine] >= lo)]
    near = np.arange(max(0, s - WINDOW), min(len(st.top) - 1, s + WINDOW + 1))
    near = near[near != s]
    if not len(mine) or not len(near):
        return None
    load = st.load[near]  # [K, dp]
    room = cap - st.bin_tok.reshape(len(st.load), dp, m)[near]  # [K, dp, M]
    c, k = st.cost[mine][:, None, None], st.tok[mine][:, None, None]
    spare = st.top[near][None, :, None] - load[None, :, :] - c  # [U, K, dp]
    ok = (spare >= 0) & (room.max(axis=2)[None, :, :] >= k)
    ok &= (((st.step_tok[near] + st.tok[mine][:, None]) <= hi) & (np.abs(near - st.home[mine][:, None]) <= DRIFT))[
        :, :, None
    ]
    gain = np.where(ok, np.minimum(c, gap), -np.inf)
    best = _best(gain, spare)
    if best is None:
        return None
    i, q, rr = (int(x) for x in best)
    fits = room[q, rr] >= st.tok[mine[i]]
    j = int(np.argmin(np.where(fits, room[q, rr], np.iinfo(np.int64).max)))
    return float(gain[best]), float(spare[best]), int(mine[i]), int(near[q]) * nb + rr * m + j
