"""The batched LPT of `balancer.planning.packing.epoch.pack_steps` for even ranks, on a layout that keeps every
NumPy call on contiguous memory.

Steps are ordered by their number of units, most first, so the steps still taking a round and the steps still
taking one tail unit are always one contiguous range of rows (no gathered copies of the load arrays), and the load
arrays are kept micro-batch-major, [micro-batch, step], so that a reduction over a replica's micro-batches adds a
few long contiguous rows. The units' costs and tokens are gathered into the grid's layout once, [column, step], and
placements are recorded there, so no call reaches into the unit arrays at random. Each step's packing is the one
`pack_steps` defines (rounds, then the tail unit by unit); only the memory layout and the order of the steps in it
differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from balancer.planning.metrics import one_f_one_b
from balancer.planning.topology import Topology


def pack_even_steps(
    grid: np.ndarray, cost: np.ndarray, tokens: np.ndarray, topology: Topology, tail: int, counts: np.ndarray
) -> np.ndarray:
    """Micro-batch of every unit (-1: fits none of its step's micro-batches). `grid[s]`: step s's units, largest
    first, -1 past its units (`epoch.by_step_grid`); a step takes rounds of one unit per micro-batch while it has at
    least `tail` rounds of units left, then its units one at a time. `counts[s]`: step s's number of units."""
    nb, cap, m = topology.bins_per_step, topology.micro_batch_tokens, topology.micro_batches
    order = np.argsort(-counts, kind="stable")  # most units first: live steps are a prefix of the rows
    units, counts = np.ascontiguousarray(grid[order].T), counts[order]  # [column, step]
    width, steps = units.shape
    safe = np.maximum(units, 0)
    load = np.zeros((nb, steps))
    used = np.zeros((nb, steps), dtype=np.int64)
    lanes = Lanes(units >= 0, cost[safe], tokens[safe], np.full((width, steps), -1, dtype=np.int64), load, used)
    falling = -counts  # ascending: searchsorted finds how many steps hold more than n units
    for first in range(0, width, nb):
        in_rounds = int(np.searchsorted(falling, -(first + tail * nb), side="right"))  # counts >= first + tail*nb
        if in_rounds:
            _round(first, min(first + nb, width), in_rounds, lanes, cap, m)
        for col in range(first, min(first + nb, width)):
            live = int(np.searchsorted(falling, -col, side="left"))  # counts > col
            if live > in_rounds:
                _tail_unit(col, in_rounds, live, lanes, topology)
    unit_bin = np.full(len(cost) + 1, -1, dtype=np.int64)
    unit_bin[units.ravel()] = lanes.bin.ravel()  # the padding's -1 cells all write the spare last entry
    return unit_bin[:-1]


@dataclass
class Lanes:
    """The packing's state: per grid cell [column, step] whether it holds a unit, its cost, tokens and micro-batch
    (-1: not placed); per [micro-batch, step] the cost and tokens placed."""

    valid: np.ndarray
    cost: np.ndarray
    tokens: np.ndarray
    bin: np.ndarray
    load: np.ndarray
    used: np.ndarray

    def place(self, cols: np.ndarray | int, rows: np.ndarray | slice, bins: np.ndarray) -> None:
        """The units of cells (cols, rows) (`cols` an array or one column; `rows` an array or, with one column, a
        slice of steps) to micro-batches `bins` of their steps, each (step, micro-batch) pair at most once per call."""
        self.bin[cols, rows] = bins
        cell = bins * self.load.shape[1] + (np.arange(rows.start, rows.stop) if isinstance(rows, slice) else rows)
        self.load.reshape(-1)[cell] += self.cost[cols, rows]
        self.used.reshape(-1)[cell] += self.tokens[cols, rows]


def _round(first: int, end: int, k: int, lanes: Lanes, cap: int, m: int) -> None:
    """One round for steps 0..k: the units of grid columns first..end (largest first) to their steps' micro-batches,
    least loaded first (ties across replicas first); a unit that overflows its micro-batch goes to the least-loaded
    one with room, or stays unplaced. The units' arrays are [column, step], the loads [micro-batch, step]: each
    step's target micro-batches are distinct, so whole columns are placed at once."""
    load, used = lanes.load, lanes.used
    bins, steps = load.shape
    valid, tok = lanes.valid[first:end, :k], lanes.tokens[first:end, :k]
    spread_order = np.argsort((np.arange(bins) % m) * (bins // m) + np.arange(bins) // m)
    if first == 0:  # the first round runs before any tail unit (pack_even_steps), so every load is still 0: it ties,
        # column c goes to the c-th micro-batch of the spread, and the loads are written, not added to
        target = spread_order[: end - first]
        fits = valid & (tok <= cap)
        lanes.bin[first:end, :k] = np.where(fits, target[:, None], -1)
        load[target, :k] = np.where(fits, lanes.cost[first:end, :k], 0.0)
        used[target, :k] = np.where(fits, tok, 0)
    else:  # least loaded first; a stable sort of the spread-ordered loads breaks ties in the spread's order
        target = spread_order[np.argsort(load[spread_order, :k].T, axis=1, kind="stable")[:, : end - first]].T
        cell = target * steps + np.arange(k)
        fits = valid & (used.reshape(-1)[cell] + tok <= cap)
        lanes.bin[first:end, :k] = np.where(fits, target, -1)
        load.reshape(-1)[cell] += np.where(fits, lanes.cost[first:end, :k], 0.0)
        used.reshape(-1)[cell] += np.where(fits, tok, 0)
    misfit = valid & ~fits
    if misfit.any():
        rows, cols = np.nonzero(misfit.T)  # by step, then column
        _misfits(rows, cols + first, lanes, cap)


def _misfits(rows: np.ndarray, cols: np.ndarray, lanes: Lanes, cap: int) -> None:
    """The round's units that overflow their micro-batch, cells (rows, cols) in step order: each step's first such
    unit, then its second..., each to the least-loaded micro-batch of its step with room (or left unplaced)."""
    load, used = lanes.load, lanes.used
    starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])
    rank = np.arange(len(rows)) - np.repeat(starts, np.diff(np.r_[starts, len(rows)]))
    for j in range(int(rank.max()) + 1):
        r, c = rows[rank == j], cols[rank == j]
        room = used[:, r].T + lanes.tokens[c, r][:, None] <= cap
        choice = np.argmin(np.where(room, load[:, r].T, np.inf), axis=1)
        ok = room[np.arange(len(r)), choice]
        lanes.place(c[ok], r[ok], choice[ok])


def _tail_unit(col: int, lo: int, hi: int, lanes: Lanes, topology: Topology) -> None:
    """The units of grid column `col` of steps lo..hi, one per step, each to the micro-batch that least raises its
    replica's 1F1B time `(P-1) * max_m t_m + sum_m t_m` (ties: the cheaper micro-batch), among those with room."""
    if topology.pp > 1:
        _tail_unit_pipelined(col, lo, hi, lanes, topology)
    else:
        _tail_unit_summed(col, lo, hi, lanes, topology)


def _tail_unit_pipelined(col: int, lo: int, hi: int, lanes: Lanes, topology: Topology) -> None:
    """`_tail_unit` with pipeline stages: every micro-batch with room is scored by its replica's new 1F1B time."""
    load, used = lanes.load, lanes.used
    dp, m, cap = topology.dp, topology.micro_batches, topology.micro_batch_tokens
    k, rows = hi - lo, np.arange(lo, hi)
    need = cap - lanes.tokens[col, lo:hi]
    per_replica = load[:, lo:hi].T.reshape(k, dp, m)
    room = used[:, lo:hi].T <= need[:, None]
    c = lanes.cost[col, lo:hi][:, None, None]
    new_time = one_f_one_b(
        np.maximum(per_replica.max(axis=2, keepdims=True), per_replica + c),
        per_replica.sum(axis=2, keepdims=True) + c,
        topology.pp,
    )
    new_time = np.where(room.reshape(k, dp, m), new_time, np.inf).reshape(k, dp * m)
    best = new_time.min(axis=1, keepdims=True)
    choice = np.argmin(np.where(new_time <= best * (1 + 1e-12), per_replica.reshape(k, dp * m), np.inf), axis=1)
    ok = np.isfinite(best[:, 0])
    lanes.place(col, rows[ok], choice[ok])


def _tail_unit_summed(col: int, lo: int, hi: int, lanes: Lanes, topology: Topology) -> None:
    """`_tail_unit` without pipeline stages, where a replica's time is its sum: the least-loaded replica with room,
    its cheapest micro-batch with room. Room is checked at the least-loaded replica first; the search over replicas
    with room runs only for the steps where that one has none (rare)."""
    load, used = lanes.load, lanes.used
    dp, m, cap = topology.dp, topology.micro_batches, topology.micro_batch_tokens
    k, rows, steps = hi - lo, np.arange(lo, hi), load.shape[1]
    need = cap - lanes.tokens[col, lo:hi]
    step_load = load[:, lo:hi].reshape(dp, m, k)
    total = step_load[:, 0].copy()
    for j in range(1, m):
        np.add(total, step_load[:, j], out=total)
    replica, best = _argmin_rows(total)
    cells = _replica_cells(replica, rows, m, steps)
    room = used.reshape(-1)[cells] <= need
    full = np.flatnonzero(~room.any(axis=0))
    if len(full):
        fullest = used[:, lo:hi].reshape(dp, m, k)[:, :, full].min(axis=1)
        total = total[:, full]
        total[fullest > need[full]] = np.inf
        replica[full], best[full] = _argmin_rows(total)
        cells[:, full] = _replica_cells(replica[full], rows[full], m, steps)
        room[:, full] = used.reshape(-1)[cells[:, full]] <= need[full]
    inside = load.reshape(-1)[cells]
    inside[~room] = np.inf
    choice = replica * m + _argmin_rows(inside)[0]
    if np.isfinite(best).all():
        lanes.place(col, slice(lo, hi), choice)
    else:
        ok = np.isfinite(best)
        lanes.place(col, rows[ok], choice[ok])


def _replica_cells(replica: np.ndarray, rows: np.ndarray, m: int, steps: int) -> np.ndarray:
    """[m, len(rows)]: the flat indices into a [micro-batch, step] array of replica `replica[i]`'s m micro-batches
    in step `rows[i]`."""
    return replica * m * steps + rows + (np.arange(m) * steps)[:, None]


def _argmin_rows(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(index of the first least row of `values` [rows, n] in every column, that least value): a running minimum over
    the few rows, without boolean-mask writes (an index moves by `(j - index) * lower`)."""
    best = values[0].copy()
    index = np.zeros(values.shape[1], dtype=np.int64)
    for j in range(1, len(values)):
        lower = values[j] < best
        np.minimum(best, values[j], out=best)
        index += (j - index) * lower
    return index, best
