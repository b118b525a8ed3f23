"""Uneven ranks (`Topology.rank_speeds`): the speed arrays the metrics and the packers divide times by.

A replica's time is its work divided by its speed; a CP group runs at its slowest member's speed. The helpers
return None for even ranks (`rank_speeds=None`; for the packers also when all speeds are equal), so the callers
keep their even-rank arithmetic unchanged: plans with speeds None, or all equal, are bit for bit the even plans.
The metrics divide by the speeds as given (equal speeds of 2 halve every time and bound).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, overload

import numpy as np

from balancer.planning.topology import Topology


def uneven(topology: Topology) -> bool:
    """True when `rank_speeds` is set and not all equal: only then do the packers weigh the ranks differently (with
    equal speeds every time is scaled alike, so every decision is the even one and the plan is the even plan)."""
    speeds = topology.rank_speeds
    return speeds is not None and min(speeds) != max(speeds)


def replica_speeds(topology: Topology) -> np.ndarray | None:
    """[dp] the speed of each replica of a static topology, what the packers divide times by (None: even ranks, or
    all speeds equal)."""
    if not uneven(topology):
        return None
    if topology.dynamic:
        raise ValueError("replica_speeds is for static topologies; a dynamic one has pool_speeds")
    return np.asarray(topology.rank_speeds, dtype=np.float64)


def bin_speeds(topology: Topology) -> np.ndarray | None:
    """[dp * M] the speed of the replica of every micro-batch of a step (None as for `replica_speeds`)."""
    speeds = replica_speeds(topology)
    return None if speeds is None else np.repeat(speeds, topology.micro_batches)


def pool_speeds(topology: Topology, planning: bool = False) -> np.ndarray | None:
    """[dp * cp] the speed of every pool rank (None: even ranks; with `planning`, also when all speeds are equal,
    as the packers see them). Static topologies repeat each replica's speed over its CP ranks."""
    if topology.rank_speeds is None or (planning and not uneven(topology)):
        return None
    speeds = np.asarray(topology.rank_speeds, dtype=np.float64)
    return speeds if topology.dynamic else np.repeat(speeds, topology.cp)


def block_speeds(speeds: np.ndarray, size: int) -> np.ndarray:
    """[pool / size] the speed of every aligned group of `size` pool ranks: its slowest member's."""
    return speeds.reshape(-1, size).min(axis=1)


@overload
def group_speeds(speeds: np.ndarray, start: np.ndarray, size: np.ndarray) -> np.ndarray: ...


@overload
def group_speeds(speeds: None, start: np.ndarray, size: np.ndarray) -> None: ...


def group_speeds(speeds: np.ndarray | None, start: np.ndarray, size: np.ndarray) -> np.ndarray | None:
    """The speed of each aligned group `[start, start + size)` of the pool (its slowest rank); None for None."""
    if speeds is None:
        return None
    start, size = np.asarray(start, dtype=np.int64), np.asarray(size, dtype=np.int64)
    out = np.empty(len(start))
    for s in np.unique(size).tolist():  # one reduction per group size (a handful), never per group
        at = size == s
        out[at] = block_speeds(speeds, int(s))[start[at] // int(s)]
    return out


def planning_view(topology: Topology) -> Topology:
    """The topology the planners decide on: without speeds when all are equal (every time scaled alike, so the
    decisions, and the plan, are the even ones; the plan then records the speeds given)."""
    return topology if uneven(topology) or topology.rank_speeds is None else replace(topology, rank_speeds=None)


def even(topology: Topology) -> Topology:
    """`topology` with even ranks (what the speed-blind decisions, such as the step count, are made on)."""
    return topology if topology.rank_speeds is None else replace(topology, rank_speeds=None)


def with_speeds(topology: Topology, speeds: np.ndarray | None, **changes: Any) -> Topology:
    """`replace(topology, **changes)` with `rank_speeds` set to `speeds` (None: even ranks)."""
    return replace(topology, rank_speeds=None if speeds is None else tuple(float(x) for x in speeds), **changes)


TOKEN_ROOM = 0.9  # a replica whose speed's share of a step's tokens is above this share of what it holds is token-bound


def token_bound(topology: Topology) -> tuple[int, int, int] | None:
    """(tokens the fastest replica's speed share of a step asks for, tokens a replica holds, the largest
    `tokens_per_step` that leaves it room) when that share is above TOKEN_ROOM of what it holds, else None (even
    ranks, or room enough). Work moves between replicas by tokens, so a token-bound fast replica gets less than its
    share of the work: the plan stays valid, just slower than the speeds allow. Dynamic CP: per pool rank."""
    speeds = topology.rank_speeds
    if speeds is None or min(speeds) == max(speeds):
        return None
    need = topology.step_tokens * max(speeds) / sum(speeds)
    if topology.dynamic:
        holds = topology.micro_batches * topology.max_tokens
    else:
        holds = topology.micro_batches * topology.micro_batch_tokens
    if need <= TOKEN_ROOM * holds:
        return None
    return int(need), int(holds), int(TOKEN_ROOM * holds * sum(speeds) / max(speeds))
