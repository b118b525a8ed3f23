"""The batched LPT of `balancer.planning.packing.epoch.pack_steps` for even ranks, on a layout that keeps every
NumPy call on contiguous memory.

Steps are ordered by their number of units, most first, so the steps still taking a round and the steps still
taking one tail unit are always one contiguous range of rows (no gathered copies of the load arrays), and the load
arrays are kept micro-batch-major, [micro-batch, step], so that a reduction over a replica's micro-batches adds a
few long contiguous rows. Each step's packing is the one `pack_steps` defines (rounds, then the tail unit by unit);
only the memory layout and the order of the steps in it differ.
"""

from __future__ import annotations

import numpy as np

from balancer.planning.metrics import one_f_one_b
from balancer.planning.topology import Topology


def pack_even_steps(
    grid: np.ndarray, cost: np.ndarray, tokens: np.ndarray, topology: Topology, tail: int
) -> np.ndarray:
    """Micro-batch of every unit (-1: fits none of its step's micro-batches). `grid[s]`: step s's units, largest
    first, -1 past its units (`epoch.by_step_grid`); a step takes rounds of one unit per micro-batch while it has at
    least `tail` rounds of units left, then its units one at a time."""
    nb, cap, m = topology.bins_per_step, topology.micro_batch_tokens, topology.micro_batches
    counts = (grid >= 0).sum(axis=1)
    order = np.argsort(-counts, kind="stable")  # most units first: live steps are a prefix of the rows
    grid, counts = grid[order], counts[order]
    steps, width = grid.shape
    load = np.zeros((nb, steps))
    used = np.zeros((nb, steps), dtype=np.int64)
    unit_bin = np.full(len(cost), -1, dtype=np.int64)
    falling = -counts  # ascending: searchsorted finds how many steps hold more than n units
    state = (cost, tokens, load, used, unit_bin)
    for first in range(0, width, nb):
        in_rounds = int(np.searchsorted(falling, -(first + tail * nb), side="right"))  # counts >= first + tail*nb
        if in_rounds:
            _round(grid[:in_rounds, first : first + nb], state, cap, m)
        for col in range(first, min(first + nb, width)):
            live = int(np.searchsorted(falling, -col, side="left"))  # counts > col
            if live > in_rounds:
                _tail_unit(grid[in_rounds:live, col], in_rounds, state, topology)
    return unit_bin


def _round(chunk: np.ndarray, state: tuple, cap: int, m: int) -> None:
    """One round for steps 0..len(chunk): the chunk's units (largest first) to their steps' micro-batches, least
    loaded first (ties across replicas first); a unit that overflows its micro-batch goes to the least-loaded one
    with room, or stays unplaced."""
    cost, tokens, load, used, unit_bin = state
    bins, k = load.shape[0], len(chunk)
    spread = np.broadcast_to((np.arange(bins) % m) * (bins // m) + np.arange(bins) // m, (k, bins))
    target = np.lexsort((spread, load[:, :k].T), axis=1)[:, : chunk.shape[1]]
    rows = np.arange(k)[:, None]
    unit = np.maximum(chunk, 0)
    fits = (chunk >= 0) & (used[target, rows] + tokens[unit] <= cap)
    r, c = np.nonzero(fits)
    _place(chunk[r, c], r, target[r, c], state)
    misfit = (chunk >= 0) & ~fits
    if not misfit.any():
        return
    ranks = np.cumsum(misfit, axis=1) - 1
    for j in range(int(misfit.sum(axis=1).max())):
        r, c = np.nonzero(misfit & (ranks == j))
        units = chunk[r, c]
        room = used[:, r].T + tokens[units][:, None] <= cap
        choice = np.argmin(np.where(room, load[:, r].T, np.inf), axis=1)
        ok = room[np.arange(len(units)), choice]
        _place(units[ok], r[ok], choice[ok], state)


def _tail_unit(units: np.ndarray, lo: int, state: tuple, topology: Topology) -> None:
    """One unit per step for steps lo..lo+len(units), each to the micro-batch that least raises its replica's 1F1B
    time `(P-1) * max_m t_m + sum_m t_m` (ties: the cheaper micro-batch), among those with room."""
    cost, tokens, load, used, unit_bin = state
    dp, m, cap = topology.dp, topology.micro_batches, topology.micro_batch_tokens
    k = len(units)
    rows = np.arange(lo, lo + k)
    if topology.pp > 1:
        per_replica = load[:, lo : lo + k].T.reshape(k, dp, m)
        room = used[:, lo : lo + k].T <= (cap - tokens[units])[:, None]
        c = cost[units][:, None, None]
        new_time = one_f_one_b(
            np.maximum(per_replica.max(axis=2, keepdims=True), per_replica + c),
            per_replica.sum(axis=2, keepdims=True) + c,
            topology.pp,
        )
        new_time = np.where(room.reshape(k, dp, m), new_time, np.inf).reshape(k, dp * m)
        best = new_time.min(axis=1, keepdims=True)
        choice = np.argmin(np.where(new_time <= best * (1 + 1e-12), per_replica.reshape(k, dp * m), np.inf), axis=1)
        ok = np.isfinite(best[:, 0])
        _place(units[ok], rows[ok], choice[ok], state)
        return
    # the replica time is its sum: the least-loaded replica with room, its cheapest micro-batch with room
    need = cap - tokens[units]
    step_load = load[:, lo : lo + k].reshape(dp, m, k)
    step_used = used[:, lo : lo + k].reshape(dp, m, k)
    total = step_load[:, 0].copy()
    fullest = step_used[:, 0].copy()
    for j in range(1, m):
        np.add(total, step_load[:, j], out=total)
        np.minimum(fullest, step_used[:, j], out=fullest)
    total[fullest > need] = np.inf
    replica, best = _argmin_rows(total)
    bins = replica * m
    flat_load, flat_used = load.reshape(-1), used.reshape(-1)
    cell = bins * load.shape[1] + rows
    inside = np.stack([flat_load[cell + j * load.shape[1]] for j in range(m)])
    room = np.stack([flat_used[cell + j * load.shape[1]] for j in range(m)]) <= need
    inside[~room] = np.inf
    ok = np.isfinite(best)
    _place(units[ok], rows[ok], bins[ok] + _argmin_rows(inside)[0][ok], state)


def _argmin_rows(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(index of the first least row of `values` [rows, n] in every column, that least value)."""
    best = values[0].copy()
    index = np.zeros(values.shape[1], dtype=np.int64)
    for j in range(1, len(values)):
        lower = values[j] < best
        np.copyto(best, values[j], where=lower)
        index[lower] = j
    return index, best


def _place(units: np.ndarray, rows: np.ndarray, bins: np.ndarray, state: tuple) -> None:
    """Units to (step row, micro-batch) pairs, each pair at most once per call (in place)."""
    cost, tokens, load, used, unit_bin = state
    unit_bin[units] = bins
    cell = bins * load.shape[1] + rows
    load.reshape(-1)[cell] += cost[units]
    used.reshape(-1)[cell] += tokens[units]
