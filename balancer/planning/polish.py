"""Local search for small steps: the best single move or swap of a unit of the slowest replica, repeated while
it lowers the step time (each round vectorised over the candidate partners)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from balancer.planning.metrics import one_f_one_b
from balancer.planning.topology import Topology


@dataclass
class _Round:
    """The step as one round of the search sees it (per micro-batch, per replica, and the slowest replica)."""

    bin_cost: np.ndarray  # [dp * M]
    bin_tokens: np.ndarray  # [dp * M]
    bin_units: np.ndarray  # [dp * M] unit counts
    largest: np.ndarray  # [dp] each replica's largest micro-batch cost
    total: np.ndarray  # [dp] each replica's summed cost
    slowest: int  # the replica that sets the step time
    time: float  # its time
    first_other: float  # the largest replica time outside `slowest`
    rest: np.ndarray  # [dp] the largest replica time outside `slowest` and x, for every x
    other_max: np.ndarray  # [dp * M] the largest other micro-batch of the bin's replica
    rep_of_bin: np.ndarray  # [dp * M] the replica of each micro-batch


def _round_state(unit_bin: np.ndarray, cost: np.ndarray, tokens: np.ndarray, topology: Topology) -> _Round:
    dp, m, nb = topology.dp, topology.micro_batches, topology.bins_per_step
    rep_of_bin = np.arange(nb) // m
    bin_cost = np.bincount(unit_bin, weights=cost, minlength=nb)
    ascending = np.sort(bin_cost.reshape(dp, m), axis=1)
    largest, second = ascending[:, -1], (ascending[:, -2] if m > 1 else np.zeros(dp))
    total = bin_cost.reshape(dp, m).sum(axis=1)
    times = one_f_one_b(largest, total, topology.pp)
    slowest = int(np.argmax(times))
    order = np.argsort(-times, kind="stable")
    first_other = times[order[1]] if dp > 1 else -np.inf
    second_other = times[order[2]] if dp > 2 else -np.inf
    return _Round(
        bin_cost=bin_cost,
        bin_tokens=np.bincount(unit_bin, weights=tokens, minlength=nb),
        bin_units=np.bincount(unit_bin, minlength=nb),
        largest=largest,
        total=total,
        slowest=slowest,
        time=times[slowest],
        first_other=first_other,
        rest=np.where(np.arange(dp) == order[min(1, dp - 1)], second_other, first_other),
        other_max=np.where(bin_cost == largest[rep_of_bin], second[rep_of_bin], largest[rep_of_bin]),
        rep_of_bin=rep_of_bin,
    )


def polish(unit_bin: np.ndarray, cost: np.ndarray, tokens: np.ndarray, topology: Topology, rounds: int = 30) -> None:
    """Local search (in place on `unit_bin`): the best single move or swap of a unit of the slowest replica,
    repeated while it lowers the step time."""
    m = topology.micro_batches
    for _ in range(rounds):
        state = _round_state(unit_bin, cost, tokens, topology)
        best, best_time = None, state.time * (1 - 1e-9)
        unit_replica = unit_bin // m
        partners = np.flatnonzero(unit_replica != state.slowest)
        for i in np.flatnonzero(unit_replica == state.slowest):
            move, move_time = _best_move(i, unit_bin, cost, tokens, state, topology)
            if move_time < best_time:
                best, best_time = ("move", i, move), move_time
            if len(partners):
                swap, swap_time = _best_swap(i, partners, unit_bin, cost, tokens, state, topology)
                if swap_time < best_time:
                    best, best_time = ("swap", i, swap), swap_time
        if best is None:
            return
        kind, i, other = best
        if kind == "move":
            unit_bin[i] = other
        else:
            unit_bin[i], unit_bin[other] = unit_bin[other], unit_bin[i]


def _best_move(
    i: int, unit_bin: np.ndarray, cost: np.ndarray, tokens: np.ndarray, state: _Round, topology: Topology
) -> tuple[int, float]:
    """The micro-batch unit `i` (on the slowest replica) would best move to, and the step time after the move."""
    m, pp, cap = topology.micro_batches, topology.pp, topology.micro_batch_tokens
    rep_of_bin = state.rep_of_bin
    r0, src, c = state.slowest, unit_bin[i], cost[i]
    left_time = one_f_one_b(max(state.other_max[src], state.bin_cost[src] - c), state.total[r0], pp, -c)
    # moves to every micro-batch of another replica
    ok = (rep_of_bin != r0) & (state.bin_tokens + tokens[i] <= cap) & (state.bin_units[src] > 1)
    joined_time = one_f_one_b(np.maximum(state.largest[rep_of_bin], state.bin_cost + c), state.total[rep_of_bin], pp, c)
    times = np.maximum(np.maximum(left_time, joined_time), state.rest[rep_of_bin])
    times = np.where(ok, times, np.inf)
    best = int(np.argmin(times))
    best_time = times[best]
    if pp > 1 and state.bin_units[src] > 1:  # inside the replica: lowers its largest micro-batch
        for j in range(r0 * m, (r0 + 1) * m):
            if j != src and state.bin_tokens[j] + tokens[i] <= cap:
                own = state.bin_cost[r0 * m : (r0 + 1) * m].copy()
                own[src - r0 * m] -= c
                own[j - r0 * m] += c
                time = max(one_f_one_b(own.max(), state.total[r0], pp), state.first_other)
                if time < best_time:
                    best, best_time = j, time
    return best, best_time


def _best_swap(
    i: int,
    partners: np.ndarray,
    unit_bin: np.ndarray,
    cost: np.ndarray,
    tokens: np.ndarray,
    state: _Round,
    topology: Topology,
) -> tuple[int, float]:
    """The unit of another replica that unit `i` would best swap with, and the step time after the swap."""
    pp, cap = topology.pp, topology.micro_batch_tokens
    rep_of_bin = state.rep_of_bin
    r0, src, c = state.slowest, unit_bin[i], cost[i]
    partner_cost, partner_bin = cost[partners], unit_bin[partners]
    fit = (state.bin_tokens[src] - tokens[i] + tokens[partners] <= cap) & (
        state.bin_tokens[partner_bin] - tokens[partners] + tokens[i] <= cap
    )
    own_time = one_f_one_b(
        np.maximum(state.other_max[src], state.bin_cost[src] - c + partner_cost), state.total[r0], pp, -c, partner_cost
    )
    partner_time = one_f_one_b(
        np.maximum(state.other_max[partner_bin], state.bin_cost[partner_bin] - partner_cost + c),
        state.total[rep_of_bin[partner_bin]],
        pp,
        -partner_cost,
        c,
    )
    times = np.where(fit, np.maximum(np.maximum(own_time, partner_time), state.rest[rep_of_bin[partner_bin]]), np.inf)
    best = int(np.argmin(times))
    return int(partners[best]), times[best]
