"""Packing every step of an epoch at once: batched LPT over padded [steps, units] arrays, so that planning does
no Python work per step.

Inside each step the units go largest first. While a step has many units left (TAIL_ROUNDS or more per
micro-batch) they go in rounds of one per micro-batch: a round's units, largest first, to the micro-batches in
order of their cost, least loaded first (ties spread over the replicas); a unit that would overflow its
micro-batch's token cap goes to the least-loaded micro-batch it fits. The last units of a step go one at a
time to the micro-batch that least raises its replica's 1F1B time `(P-1) * max_m t_m + sum_m t_m` (rounds
would leave the last micro-batches uneven). A unit that fits nowhere stays unplaced (-1). Every operation is one
NumPy call over all steps together: the loops run over a step's units (in rounds, then one by one), never over
steps.

With uneven ranks (`Topology.rank_speeds`) equal rounds would give every micro-batch as many units, whatever
its replica's speed; so the rounds are dealt by deficit instead: each micro-batch gets a target share of its
step's work proportional to its replica's speed, and a round's units go to the micro-batches still below target,
neediest first (as `pack_step` deals its light units); the last units go one at a time where they raise their
replica's time (1F1B time / speed) least.

The planner keeps this packing where it is within FAST_ENOUGH of the step's lower bound and re-packs the other
steps with `pack_step` (water-filling, heavy units, pipelining, the local search), see
balancer.planning.planner.
"""

from __future__ import annotations

import numpy as np

from balancer.planning.metrics import lower_bound, one_f_one_b, step_times
from balancer.planning.packing.lanes import pack_even_steps
from balancer.planning.packing.rowops import argmin_last, last_axis
from balancer.planning.packing.search import polish_steps
from balancer.planning.packing.step import POLISH_ABOVE, POLISH_MAX_UNITS, pack_step, step_time
from balancer.planning.speeds import bin_speeds, replica_speeds
from balancer.planning.topology import Topology

TAIL_ROUNDS = 2  # a step's last this-many rounds of units go one unit at a time (rounds leave the last ones uneven)
FAST_ENOUGH = 1.01  # a step keeps its batched packing when its time is within this factor of its lower bound ...
FEW_UNITS = 2  # ... or, with at most this many units per micro-batch, ...
FEW_FAST_ENOUGH = 1.002  # ... within this factor
REPACK_SKIP = 1e-3  # re-packing steps that could gain at most this share of the epoch's time is not worth it
REPACK_SAMPLE = 32  # steps on which pack_step is tried before re-packing many steps


def pack_steps(cost: np.ndarray, tokens: np.ndarray, ptr: np.ndarray, topology: Topology) -> np.ndarray:
    """Micro-batch (replica * M + m) of every unit, for units given step by step (`ptr[s]:ptr[s + 1]` is step
    s); -1 for a unit that fits no micro-batch of its step."""
    if replica_speeds(topology) is not None:
        return _pack_steps_uneven(cost, tokens, ptr, topology)
    return pack_even_steps(by_step_grid(-cost, ptr, tokens), cost, tokens, topology, TAIL_ROUNDS, np.diff(ptr))


def _pack_steps_uneven(cost: np.ndarray, tokens: np.ndarray, ptr: np.ndarray, topology: Topology) -> np.ndarray:
    """`pack_steps` for uneven ranks: rounds by deficit against speed-proportional targets, then one unit at a time
    (module docstring). Every step advances through its own units (rounds of different sizes), all steps at once."""
    nb, cap = topology.bins_per_step, topology.micro_batch_tokens
    speed = bin_speeds(topology)
    assert speed is not None, "the uneven path: rank speeds are set"
    steps, counts = len(ptr) - 1, np.diff(ptr)
    grid = by_step_grid(-cost, ptr, tokens)
    width = grid.shape[1]
    work = np.bincount(np.repeat(np.arange(steps), counts), weights=cost, minlength=steps)
    deficit = work[:, None] * (speed / speed.sum())[None, :]  # [steps, nb] each micro-batch's share of its step
    load = np.zeros((steps, nb))
    used = np.zeros((steps, nb), dtype=np.int64)
    unit_bin = np.full(len(cost), -1, dtype=np.int64)
    at = np.zeros(steps, dtype=np.int64)  # each step's next unit (grid column)
    lane = np.arange(nb)
    rows = np.flatnonzero(counts - at >= TAIL_ROUNDS * nb)
    while len(rows):
        need = deficit[rows]
        k = np.minimum((need > 0).sum(axis=1), counts[rows] - at[rows])
        target = np.argsort(-need, axis=1, kind="stable")  # neediest first, ties in micro-batch order
        chunk = np.where(lane < k[:, None], grid[rows[:, None], np.minimum(at[rows][:, None] + lane, width - 1)], -1)
        # a round stops at the first micro-batch whose deficit is below half its unit (as pack_step's rounds)
        short = (chunk >= 0) & (np.take_along_axis(need, target, axis=1) < 0.5 * cost[np.maximum(chunk, 0)])
        k = np.where(short.any(axis=1), np.maximum(np.argmax(short, axis=1), np.minimum(k, 1)), k)
        chunk = np.where(lane < k[:, None], chunk, -1)
        unit = np.maximum(chunk, 0)
        fits = (chunk >= 0) & (np.take_along_axis(used[rows], target, axis=1) + tokens[unit] <= cap)
        r, c = np.nonzero(fits)
        _place(chunk[r, c], rows[r], target[r, c], cost, tokens, load, used, unit_bin)
        deficit[rows[r], target[r, c]] -= cost[chunk[r, c]]
        r, c = np.nonzero((chunk >= 0) & ~fits)  # the matched micro-batch is full: the neediest with room
        for unit_id, row in zip(chunk[r, c].tolist(), rows[r].tolist()):  # rare: token-full micro-batches
            room = np.where(used[row] + tokens[unit_id] <= cap, deficit[row], -np.inf)
            j = int(np.argmax(room))
            if np.isfinite(room[j]):
                _place(np.array([unit_id]), np.array([row]), np.array([j]), cost, tokens, load, used, unit_bin)
                deficit[row, j] -= cost[unit_id]
        at[rows] += k
        rows = rows[(k > 0) & (counts[rows] - at[rows] >= TAIL_ROUNDS * nb)]
    rest = np.flatnonzero(at < counts)
    while len(rest):  # the last units of every step: one at a time, where they raise their replica's time least
        _greedy(grid[rest, at[rest]], rest, cost, tokens, load, used, unit_bin, topology)
        at[rest] += 1
        rest = rest[at[rest] < counts[rest]]
    return unit_bin


def by_step_grid(key: np.ndarray, ptr: np.ndarray, tokens: np.ndarray | None = None) -> np.ndarray:
    """[steps, most units of a step]: each step's units (`ptr[s]:ptr[s + 1]`) in ascending order of `key`, ties in
    their given order (a stable sort, row by row: the same on every machine), -1 past the step's units. The grid is
    padded to the largest step: callers keep the steps' sizes comparable (`pack_light_steps`). `tokens`: the units'
    token counts; where `key` is a function of them (a cost model's cost), the rows are sorted as small integers
    (`_rank_by_tokens`), the same order."""
    steps, counts = len(ptr) - 1, np.diff(ptr)
    width = int(counts.max()) if steps else 0
    at = np.arange(len(key)) + np.repeat(np.arange(steps) * width - ptr[:-1], counts)  # each unit's cell
    bits = max(1, (width - 1).bit_length())  # a unit's place in its step takes the low bits of its sort key
    rank = _rank_by_tokens(key, tokens, bits) if steps and tokens is not None else None
    if rank is not None:  # unique integer keys (rank, then the given order): an unstable sort gives the stable order
        cells = np.full(steps * width, np.iinfo(np.int32).max, dtype=np.int32)
        local = np.arange(len(key), dtype=np.int32) - np.repeat(ptr[:-1].astype(np.int32), counts)
        cells[at] = (rank << bits) | local
        grid = (np.sort(cells.reshape(steps, width), axis=1) & ((1 << bits) - 1)) + ptr[:-1, None]
    else:
        keys = np.full(steps * width, np.inf)
        keys[at] = key
        grid = np.argsort(keys.reshape(steps, width), axis=1, kind="stable") + ptr[:-1, None]
    grid[np.arange(width)[None, :] >= counts[:, None]] = -1
    return grid


RANK_TOKENS = 1 << 20  # token counts up to this are ranked through a table indexed by tokens


def _rank_by_tokens(key: np.ndarray, tokens: np.ndarray, bits: int) -> np.ndarray | None:
    """Dense rank of every unit's `key` (equal keys, equal ranks) as int32, or None where `key` is not a function of
    `tokens` (two units with the same tokens and different keys) or the ranks shifted by `bits` overflow int32."""
    if len(key) >= 1 << 31 or tokens.min() < 0 or tokens.max() >= RANK_TOKENS:
        return None
    table = np.zeros(int(tokens.max()) + 1)
    table[tokens] = key
    if not np.array_equal(table[tokens], key):
        return None
    present = np.zeros(len(table), dtype=bool)
    present[tokens] = True
    values = np.flatnonzero(present)
    by_key = values[np.argsort(table[values], kind="stable")]
    dense = np.concatenate([[0], np.cumsum(np.diff(table[by_key]) != 0)])
    if (int(dense[-1]) + 2) << bits >= np.iinfo(np.int32).max:
        return None
    ranks = np.zeros(len(table), dtype=np.int32)
    ranks[by_key] = dense
    return ranks[tokens]


def _greedy(units, rows, cost, tokens, load, used, unit_bin, topology: Topology) -> None:
    """One unit per step (`units[i]` of step `rows[i]`) to the micro-batch that least raises its replica's 1F1B
    time `(P-1) * max_m t_m + sum_m t_m` (ties: the cheaper micro-batch), among those with room."""
    dp, m, cap = topology.dp, topology.micro_batches, topology.micro_batch_tokens
    every = len(rows) == len(load)  # all steps take part: views, no copies
    step_load = load if every else load[rows]
    step_used = used if every else used[rows]
    per_replica = step_load.reshape(len(rows), dp, m)
    speeds = replica_speeds(topology)
    if topology.pp == 1:  # the replica time is its sum: the least-loaded replica with room, its cheapest bin
        need = (cap - tokens[units])[:, None]
        per_used = step_used.reshape(len(rows), dp, m)
        total = last_axis(np.add, per_replica)
        if speeds is not None:  # the replica that finishes first with the unit
            total = (total + cost[units][:, None]) / speeds
        total[last_axis(np.minimum, per_used) > need] = np.inf
        replica = argmin_last(total)
        at = np.arange(len(rows))
        inside = per_replica[at, replica]
        inside[per_used[at, replica] > need] = np.inf
        choice, ok = replica * m + argmin_last(inside), np.isfinite(total[at, replica])
    else:  # with more stages, (P-1) times its largest micro-batch on top
        room = step_used <= (cap - tokens[units])[:, None]
        c = cost[units][:, None, None]
        new_time = one_f_one_b(
            np.maximum(per_replica.max(axis=2, keepdims=True), per_replica + c),
            per_replica.sum(axis=2, keepdims=True) + c,
            topology.pp,
        )
        if speeds is not None:
            new_time = new_time / speeds[None, :, None]
        new_time = np.where(room.reshape(len(rows), dp, m), new_time, np.inf).reshape(len(rows), dp * m)
        best = new_time.min(axis=1, keepdims=True)
        choice = np.argmin(np.where(new_time <= best * (1 + 1e-12), step_load, np.inf), axis=1)
        ok = np.isfinite(best[:, 0])
    _place(units[ok], rows[ok], choice[ok], cost, tokens, load, used, unit_bin)


def _place(units, rows, bins, cost, tokens, load, used, unit_bin) -> None:
    """Units to (step row, micro-batch) pairs, each pair at most once per call (in place)."""
    unit_bin[units] = bins
    cell = rows * load.shape[1] + bins  # flat indices: twice as fast as (rows, bins) pairs
    load.reshape(-1)[cell] += cost[units]
    used.reshape(-1)[cell] += tokens[units]


def step_quality(
    unit_bin: np.ndarray, cost: np.ndarray, ptr: np.ndarray, topology: Topology
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per step of a batched packing: its time and its lower bound (section-3 model, per-CP-rank cost units), and
    whether it is complete (every unit placed, no micro-batch empty)."""
    steps, nb = len(ptr) - 1, topology.bins_per_step
    step = np.repeat(np.arange(steps), np.diff(ptr))
    placed = unit_bin >= 0
    every = bool(placed.all())  # the usual case: no masked copies
    slot = step * nb + unit_bin if every else step[placed] * nb + unit_bin[placed]
    mb = np.bincount(slot, weights=cost if every else cost[placed], minlength=steps * nb)
    times = step_times(mb.reshape(steps, topology.dp, topology.micro_batches), topology)
    work = np.bincount(step, weights=cost, minlength=steps)
    heaviest = np.zeros(steps)
    filled_steps = np.diff(ptr) > 0
    heaviest[filled_steps] = np.maximum.reduceat(cost, ptr[:-1][filled_steps]) if len(cost) else 0.0
    bound = lower_bound(work, heaviest, topology)
    filled = np.bincount(slot, minlength=steps * nb).reshape(steps, nb) > 0
    complete = filled.all(axis=1)
    if not every:
        complete = complete & (np.bincount(step[~placed], minlength=steps) == 0)
    return times, bound, np.asarray(complete)


def steps_to_repack(
    unit_bin: np.ndarray, cost: np.ndarray, tokens: np.ndarray, ptr: np.ndarray, topology: Topology
) -> tuple[np.ndarray, np.ndarray]:
    """(steps of the batched packing that go to `pack_step`, steps that are complete: every unit placed, no
    micro-batch empty), after the batched local search (in place on `unit_bin`, the micro-batch of each unit; step
    s is `ptr[s]:ptr[s + 1]`).

    Small steps off their bound are polished as `pack_step` polishes them. A step is re-packed when incomplete, or
    when it stays above FAST_ENOUGH of its bound (FEW_FAST_ENOUGH with at most FEW_UNITS units per micro-batch,
    where `pack_step`'s water-filling and spill to the next step get closer than LPT), except the least excess
    steps that together could gain at most REPACK_SKIP of the epoch; and except all of them when `pack_step`, tried
    on a sample of them, would gain less than that (a pipeline's bubble, say, keeps every packing off the bound).
    """
    times, bound, complete = step_quality(unit_bin, cost, ptr, topology)
    sizes = np.diff(ptr)
    few = sizes <= FEW_UNITS * topology.bins_per_step
    polish = complete & (sizes <= POLISH_MAX_UNITS) & (times > np.where(few, POLISH_ABOVE, FAST_ENOUGH) * bound)
    if polish.any():  # a polished step keeps its units, so its bound, and every micro-batch filled
        polished = np.flatnonzero(polish)
        polish_steps(unit_bin, cost, tokens, ptr, polished, topology)
        counts = sizes[polished]
        cells = np.repeat(ptr[polished] - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))
        times[polished] = step_quality(unit_bin[cells], cost[cells], np.append(0, np.cumsum(counts)), topology)[0]
    repack = ~complete | (times > np.where(few, FEW_FAST_ENOUGH, FAST_ENOUGH) * bound)
    candidates = np.flatnonzero(repack & complete)
    excess = times[candidates] - bound[candidates]
    by_excess = np.argsort(excess, kind="stable")
    repack[candidates[by_excess[np.cumsum(excess[by_excess]) <= REPACK_SKIP * bound.sum()]]] = False
    candidates = np.flatnonzero(repack & complete)
    if len(candidates) >= 4 * REPACK_SAMPLE:
        sample = candidates[np.linspace(0, len(candidates) - 1, REPACK_SAMPLE).astype(np.int64)]
        gain = sum(max(0.0, times[s] - _pack_step_time(s, cost, tokens, ptr, topology)) for s in sample)
        if gain * len(candidates) / len(sample) <= REPACK_SKIP * bound.sum():
            repack[candidates] = False
    return repack, complete


def _pack_step_time(s: int, cost: np.ndarray, tokens: np.ndarray, ptr: np.ndarray, topology: Topology) -> float:
    """Step s's time when `pack_step` packs it (a unit it leaves for the next step counts its cost)."""
    units = slice(ptr[s], ptr[s + 1])
    return step_time(pack_step(cost[units], tokens[units], topology), cost[units], topology)


def pack_light_steps(
    flat: np.ndarray, ptr: np.ndarray, u_cost: np.ndarray, u_tok: np.ndarray, attn_heavy: np.ndarray, topology: Topology
) -> np.ndarray:
    """The batched packing (`pack_steps`) of the steps without attention-heavy units (units `flat`, step s being
    `ptr[s]:ptr[s + 1]`); -1 for the units of the other steps, which need `pack_step`'s water-filling (a heavy
    unit costs more per token than the rest, so balancing its step takes the token room into account), and of
    steps with over 4x the median number of units (the padded arrays stay within 4x the units)."""
    sizes = np.diff(ptr)
    heavy = np.zeros(len(sizes), dtype=np.int64)
    if attn_heavy.any():
        heavy[sizes > 0] = np.add.reduceat(attn_heavy[flat].astype(np.int64), ptr[:-1][sizes > 0])
    batched = heavy == 0
    if batched.any():  # padded arrays: a step far larger than the others (tiny documents) goes to pack_step
        batched &= sizes <= max(4 * topology.bins_per_step, 4 * int(np.median(sizes[batched])))
    if batched.all():  # every step: no gathers of the light steps' units
        return pack_steps(u_cost[flat], u_tok[flat], ptr, topology)
    light = np.repeat(batched, sizes)
    out = np.full(len(flat), -1, dtype=np.int64)
    if light.any():
        units = flat[light]
        out[light] = pack_steps(u_cost[units], u_tok[units], np.concatenate([[0], np.cumsum(sizes[batched])]), topology)
    return out


def by_micro_batch(flat: np.ndarray, ptr: np.ndarray, unit_bin: np.ndarray, nb: int) -> tuple[np.ndarray, np.ndarray]:
    """(the units `flat` sorted by step, then micro-batch `unit_bin` (-1 first), then unit; [steps, nb] sizes) for
    steps `ptr[s]:ptr[s + 1]`. Where every step's units are in ascending order (as steps are cut from the shuffled
    order), each step is sorted on its own as small integers; otherwise one sort of the whole epoch."""
    steps, counts = len(ptr) - 1, np.diff(ptr)
    slot = np.repeat(np.arange(steps) * (nb + 1), counts) + unit_bin + 1
    sizes = np.bincount(slot, minlength=steps * (nb + 1)).reshape(steps, nb + 1)[:, 1:]
    width = int(counts.max()) if steps else 0
    bits = max(1, (width - 1).bit_length())
    inner = np.ones(max(len(flat) - 1, 0), dtype=bool)
    inner[ptr[1:-1][(ptr[1:-1] > 0) & (ptr[1:-1] < len(flat))] - 1] = False  # pairs across a step boundary
    if not width or (nb + 2) << bits >= np.iinfo(np.int32).max or not np.all(np.diff(flat)[inner] > 0):
        n = max(len(flat), int(flat.max()) + 1 if len(flat) else 1)
        if steps * (nb + 1) < 2**62 // n:
            return flat[np.argsort(slot * n + flat)], sizes
        return flat[np.lexsort((flat, slot))], sizes
    local = np.arange(len(flat), dtype=np.int32) - np.repeat(ptr[:-1].astype(np.int32), counts)
    cells = np.full(steps * width, np.iinfo(np.int32).max, dtype=np.int32)
    cells[local + np.repeat(np.arange(steps) * width, counts)] = ((unit_bin + 1).astype(np.int32) << bits) | local
    ordered = np.sort(cells.reshape(steps, width), axis=1)[np.arange(width)[None, :] < counts[:, None]]
    return flat[(ordered & ((1 << bits) - 1)) + np.repeat(ptr[:-1], counts)], sizes


class LazySteps:
    """Step s's slice of the batched packing (None where it is incomplete), made when asked for; a step whose units
    changed is forgotten (set to None)."""

    def __init__(self, unit_bin: np.ndarray, ptr: np.ndarray, complete: np.ndarray) -> None:
        self.unit_bin, self.ptr, self.usable = unit_bin, ptr, complete.copy()

    def __len__(self) -> int:
        return len(self.usable)

    def __getitem__(self, s: int):
        return self.unit_bin[self.ptr[s] : self.ptr[s + 1]] if self.usable[s] else None

    def __setitem__(self, s: int, value: None) -> None:  # only forgetting: `fast[s] = None`
        self.usable[s] = False
