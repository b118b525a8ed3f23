"""Local search for small steps, batched over steps: in every step still improving, the best single move or swap
of a unit of the slowest replica, applied while it lowers the step time.

A round considers, for each unit on the step's slowest replica, moving it to any micro-batch of another replica
with token room (with pipeline stages also to another micro-batch of its own replica, which lowers the replica's
largest micro-batch) and swapping it with any lighter unit of another replica (both micro-batches keep their token
room; only a lighter partner can lower the slowest replica).
A move never empties a micro-batch. Each round is a fixed number of NumPy calls over all steps together, so the
search costs no Python work per step; `polish` is the one-step form that `pack_step` calls. With uneven ranks
(`Topology.rank_speeds`) every replica time is divided by its replica's speed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from balancer.planning.metrics import one_f_one_b
from balancer.planning.speeds import replica_speeds
from balancer.planning.topology import Topology

IMPROVES = 1 - 1e-9  # a move is taken only when it lowers the step time by more than rounding
CHUNK_CELLS = 1 << 21  # steps are searched in chunks of about this many (step, unit, partner) cells


@dataclass
class _Steps:
    """The steps being polished as padded [steps, most units] arrays (-1 / 0 past a step's units)."""

    unit: np.ndarray  # [S, W] unit index, -1 past the step's units
    bin: np.ndarray  # [S, W] micro-batch of each unit (replica * M + m); -1 past the step's units
    cost: np.ndarray  # [S, W]
    tokens: np.ndarray  # [S, W]


@dataclass
class _Loads:
    """Per step of one round: micro-batch loads, replica times, the slowest replica and the other replicas."""

    bin_cost: np.ndarray  # [S, nb]
    bin_tokens: np.ndarray  # [S, nb]
    bin_units: np.ndarray  # [S, nb]
    largest: np.ndarray  # [S, dp] each replica's largest micro-batch
    total: np.ndarray  # [S, dp] each replica's summed cost
    other_max: np.ndarray  # [S, nb] the largest other micro-batch of the bin's replica
    slowest: np.ndarray  # [S] the replica that sets the step time
    time: np.ndarray  # [S] the step time
    first_other: np.ndarray  # [S] the largest replica time outside `slowest`
    rest: np.ndarray  # [S, dp] the largest replica time outside `slowest` and the replica
    speeds: np.ndarray | None = None  # [dp] replica speeds (None: even ranks)

    def per(self, work: np.ndarray, replica) -> np.ndarray:
        """`work` (1F1B work-times) on `replica` (broadcast against it) as times: divided by its speed."""
        return work if self.speeds is None else work / self.speeds[replica]


def polish(unit_bin: np.ndarray, cost: np.ndarray, tokens: np.ndarray, topology: Topology, rounds: int = 30) -> None:
    """Local search on one step (in place on `unit_bin`, every unit placed)."""
    polish_steps(unit_bin, cost, tokens, np.array([0, len(unit_bin)]), np.array([0]), topology, rounds)


def polish_steps(
    unit_bin: np.ndarray,
    cost: np.ndarray,
    tokens: np.ndarray,
    ptr: np.ndarray,
    steps: np.ndarray,
    topology: Topology,
    rounds: int = 30,
) -> None:
    """Local search (in place on `unit_bin`, the micro-batch of each unit) on the steps `steps`, step s being units
    `ptr[s]:ptr[s + 1]`, every one of them placed: at most `rounds` improving moves or swaps per step."""
    steps = np.asarray(steps, dtype=np.int64)
    if not len(steps):
        return
    width = int((ptr[steps + 1] - ptr[steps]).max())
    chunk = max(1, CHUNK_CELLS // (width * max(width, topology.bins_per_step)))  # bounds the [steps, k, W] arrays
    for first in range(0, len(steps), chunk):
        grid = _gather(unit_bin, cost, tokens, ptr, steps[first : first + chunk])
        active = np.arange(len(grid.unit))
        for _ in range(rounds):
            if not len(active):
                break
            sub = _Steps(grid.unit[active], grid.bin[active], grid.cost[active], grid.tokens[active])
            improved = _one_round(sub, topology)
            grid.bin[active] = sub.bin
            active = active[improved]
        placed = grid.unit >= 0
        unit_bin[grid.unit[placed]] = grid.bin[placed]


def _gather(unit_bin, cost, tokens, ptr, steps) -> _Steps:
    counts = ptr[steps + 1] - ptr[steps]
    width = int(counts.max()) if len(steps) else 0
    col = np.arange(width)
    unit = np.where(col[None, :] < counts[:, None], ptr[steps][:, None] + col[None, :], -1)
    valid = unit >= 0
    safe = np.maximum(unit, 0)
    return _Steps(
        unit,
        np.where(valid, unit_bin[safe], -1),
        np.where(valid, cost[safe], 0.0),
        np.where(valid, tokens[safe], 0),
    )


def _loads(grid: _Steps, topology: Topology) -> _Loads:
    dp, m, nb = topology.dp, topology.micro_batches, topology.bins_per_step
    n = len(grid.unit)
    valid = grid.bin >= 0
    slot = (np.arange(n)[:, None] * nb + grid.bin)[valid]
    bin_cost = np.bincount(slot, weights=grid.cost[valid], minlength=n * nb).reshape(n, nb)
    bin_tokens = np.bincount(slot, weights=grid.tokens[valid], minlength=n * nb).reshape(n, nb)
    bin_units = np.bincount(slot, minlength=n * nb).reshape(n, nb)
    ascending = np.sort(bin_cost.reshape(n, dp, m), axis=2)
    largest = ascending[:, :, -1]
    second = ascending[:, :, -2] if m > 1 else np.zeros((n, dp))
    total = ascending.sum(axis=2)
    times = one_f_one_b(largest, total, topology.pp)
    speeds = replica_speeds(topology)
    if speeds is not None:
        times = times / speeds
    order = np.argsort(-times, axis=1, kind="stable")
    rows = np.arange(n)
    slowest = order[:, 0]
    first_other = times[rows, order[:, 1]] if dp > 1 else np.full(n, -np.inf)
    second_other = times[rows, order[:, 2]] if dp > 2 else np.full(n, -np.inf)
    at_top = bin_cost == np.repeat(largest, m, axis=1)
    return _Loads(
        bin_cost=bin_cost,
        bin_tokens=bin_tokens,
        bin_units=bin_units,
        largest=largest,
        total=total,
        other_max=np.where(at_top, np.repeat(second, m, axis=1), np.repeat(largest, m, axis=1)),
        slowest=slowest,
        time=times[rows, slowest],
        first_other=first_other,
        rest=np.where(
            np.arange(dp)[None, :] == order[:, min(1, dp - 1)][:, None], second_other[:, None], first_other[:, None]
        ),
        speeds=speeds,
    )


def _one_round(grid: _Steps, topology: Topology) -> np.ndarray:
    """Apply in every step its best improving move or swap (in place on `grid.bin`); returns which steps improved."""
    loads = _loads(grid, topology)
    m = topology.micro_batches
    rows = np.arange(len(grid.unit))
    on_slow = (grid.bin >= 0) & (grid.bin // m == loads.slowest[:, None])
    k = int(on_slow.sum(axis=1).max())
    if k == 0:
        return np.zeros(len(rows), dtype=bool)
    pick = np.argsort(~on_slow, axis=1, kind="stable")[:, :k]  # [S, k] grid columns of the slowest replica's units
    mover = _Mover(
        live=np.take_along_axis(on_slow, pick, axis=1),
        src=np.maximum(np.take_along_axis(grid.bin, pick, axis=1), 0),
        cost=np.take_along_axis(grid.cost, pick, axis=1),
        tokens=np.take_along_axis(grid.tokens, pick, axis=1),
        rows=rows[:, None],
    )
    out_moves = _moves_out(mover, loads, topology)
    in_moves = _moves_inside(mover, loads, topology) if topology.pp > 1 else out_moves[:, :, :0]
    times = np.concatenate([out_moves, in_moves, _swaps(mover, grid, loads, topology)], axis=2)  # [S, k, nb+M+W]
    flat = times.reshape(len(rows), -1)
    best = np.argmin(flat, axis=1)
    improved = flat[rows, best] < loads.time * IMPROVES
    at, choice = np.divmod(best[improved], times.shape[2])
    step = rows[improved]
    col = pick[step, at]
    n_out, n_in = out_moves.shape[2], in_moves.shape[2]
    move_out, move_in, swap = choice < n_out, (choice >= n_out) & (choice < n_out + n_in), choice >= n_out + n_in
    grid.bin[step[move_out], col[move_out]] = choice[move_out]
    grid.bin[step[move_in], col[move_in]] = loads.slowest[step[move_in]] * m + choice[move_in] - n_out
    step, col, partner = step[swap], col[swap], choice[swap] - n_out - n_in
    grid.bin[step, col], grid.bin[step, partner] = grid.bin[step, partner], grid.bin[step, col]
    return improved


@dataclass
class _Mover:
    """The units of each step's slowest replica, [S, k] (padded: `live` is False past a step's units)."""

    live: np.ndarray
    src: np.ndarray  # their micro-batch
    cost: np.ndarray
    tokens: np.ndarray
    rows: np.ndarray  # [S, 1] step row, for indexing [S, nb] arrays


def _slow_replica(mv: _Mover, loads: _Loads):
    """(the slowest replica's summed cost [S, 1], each unit's micro-batch cost, tokens and largest other [S, k])."""
    step = mv.rows[:, 0]
    return (
        loads.total[step, loads.slowest][:, None],
        loads.bin_cost[mv.rows, mv.src],
        loads.bin_tokens[mv.rows, mv.src],
        loads.other_max[mv.rows, mv.src],
    )


def _slow(loads: _Loads) -> np.ndarray:
    """[S, 1] each step's slowest replica (to broadcast against [S, k] arrays)."""
    return loads.slowest[:, None]


def _moves_out(mv: _Mover, loads: _Loads, topology: Topology) -> np.ndarray:
    """[S, k, nb] step time after moving unit k to micro-batch b of another replica (inf: not allowed)."""
    pp, cap = topology.pp, topology.micro_batch_tokens
    rep_b = np.arange(topology.bins_per_step) // topology.micro_batches
    slow_total, src_cost, _, src_other = _slow_replica(mv, loads)
    left = loads.per(one_f_one_b(np.maximum(src_other, src_cost - mv.cost), slow_total, pp, -mv.cost), _slow(loads))
    c = mv.cost[..., None]
    joined = one_f_one_b(
        np.maximum(loads.largest[:, rep_b][:, None, :], loads.bin_cost[:, None, :] + c),
        loads.total[:, rep_b][:, None, :],
        pp,
        c,
    )
    joined = loads.per(joined, rep_b[None, None, :])
    times = np.maximum(np.maximum(left[..., None], joined), loads.rest[:, rep_b][:, None, :])
    ok = (mv.live & (loads.bin_units[mv.rows, mv.src] > 1))[..., None]
    ok = ok & (rep_b[None, :] != loads.slowest[:, None])[:, None, :]
    ok = ok & (loads.bin_tokens[:, None, :] + mv.tokens[..., None] <= cap)
    return np.where(ok, times, np.inf)


def _moves_inside(mv: _Mover, loads: _Loads, topology: Topology) -> np.ndarray:
    """[S, k, M] step time after moving unit k to micro-batch m of its own (the slowest) replica, which lowers the
    replica's largest micro-batch (pipeline stages only)."""
    m, pp, cap = topology.micro_batches, topology.pp, topology.micro_batch_tokens
    step = mv.rows[:, 0]
    first = (loads.slowest * m)[:, None] + np.arange(m)[None, :]  # [S, M] the slowest replica's micro-batches
    own_cost, own_tokens = loads.bin_cost[mv.rows, first], loads.bin_tokens[mv.rows, first]
    slow_total = loads.total[step, loads.slowest][:, None, None]
    j = np.arange(m)
    here = j[None, None, :] == (mv.src - loads.slowest[:, None] * m)[..., None]  # [S, k, M] the unit's own bin
    base = own_cost[:, None, :] - np.where(here, mv.cost[..., None], 0.0)  # the replica without the unit
    ascending = np.sort(base, axis=2)
    top, second = ascending[..., -1:], ascending[..., -2:-1] if m > 1 else np.zeros_like(ascending[..., -1:])
    largest = np.maximum(np.where(base == top, second, top), base + mv.cost[..., None])
    times = loads.per(one_f_one_b(largest, slow_total, pp), _slow(loads)[..., None])
    times = np.maximum(times, loads.first_other[:, None, None])
    ok = (mv.live & (loads.bin_units[mv.rows, mv.src] > 1))[..., None] & ~here
    ok = ok & (own_tokens[:, None, :] + mv.tokens[..., None] <= cap)
    return np.where(ok, times, np.inf)


def _swaps(mv: _Mover, grid: _Steps, loads: _Loads, topology: Topology) -> np.ndarray:
    """[S, k, W] step time after swapping unit k with the step's unit w on another replica (inf: not allowed). Only
    a lighter partner can lower the slowest replica, so heavier ones are not considered."""
    m, pp, cap = topology.micro_batches, topology.pp, topology.micro_batch_tokens
    partner_bin = np.maximum(grid.bin, 0)
    partner_rep = partner_bin // m
    slow_total, src_cost, src_tokens, src_other = _slow_replica(mv, loads)
    gain = grid.cost[:, None, :] - mv.cost[..., None]  # what the slowest replica's unit cost changes by
    shift = grid.tokens[:, None, :] - mv.tokens[..., None]
    partner_total = loads.total[mv.rows, partner_rep][:, None, :]
    own_largest = partner_largest = 0.0  # with one stage the largest micro-batch does not count
    if pp > 1:
        own_largest = np.maximum(src_other[..., None], src_cost[..., None] + gain)
        partner_largest = np.maximum(
            loads.other_max[mv.rows, partner_bin][:, None, :], loads.bin_cost[mv.rows, partner_bin][:, None, :] - gain
        )
    times = np.maximum(
        loads.per(one_f_one_b(own_largest, slow_total[..., None] + gain, pp), _slow(loads)[..., None]),
        loads.per(one_f_one_b(partner_largest, partner_total - gain, pp), partner_rep[:, None, :]),
    )
    times = np.maximum(times, loads.rest[mv.rows, partner_rep][:, None, :])
    partner_ok = (grid.bin >= 0) & (partner_rep != loads.slowest[:, None])
    ok = mv.live[..., None] & partner_ok[:, None, :] & (gain < 0)
    ok &= (shift <= cap - src_tokens[..., None]) & (shift >= loads.bin_tokens[mv.rows, partner_bin][:, None, :] - cap)
    return np.where(ok, times, np.inf)
