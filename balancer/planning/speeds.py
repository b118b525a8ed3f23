"""Uneven ranks (`Topology.rank_speeds`): the speed arrays the metrics and the packers divide times by.

A replica's time is its work divided by its speed; a CP group runs at its slowest member's speed. Every helper
returns None for even ranks (`rank_speeds=None`), so the callers keep their even-rank arithmetic unchanged (plans
with speeds None are bit for bit what they were).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from balancer.planning.topology import Topology


def replica_speeds(topology: Topology) -> np.ndarray | None:
    """[dp] the speed of each replica of a static topology (None: even ranks)."""
    if topology.rank_speeds is None:
        return None
    if topology.dynamic:
        raise ValueError("replica_speeds is for static topologies; a dynamic one has pool_speeds")
    return np.asarray(topology.rank_speeds, dtype=np.float64)


def bin_speeds(topology: Topology) -> np.ndarray | None:
    """[dp * M] the speed of the replica of every micro-batch of a step (None: even ranks)."""
    speeds = replica_speeds(topology)
    return None if speeds is None else np.repeat(speeds, topology.micro_batches)


def pool_speeds(topology: Topology) -> np.ndarray | None:
    """[dp * cp] the speed of every pool rank (dynamic CP; None: even ranks)."""
    if topology.rank_speeds is None:
        return None
    speeds = np.asarray(topology.rank_speeds, dtype=np.float64)
    return speeds if topology.dynamic else np.repeat(speeds, topology.cp)


def block_speeds(speeds: np.ndarray, size: int) -> np.ndarray:
    """[pool / size] the speed of every aligned group of `size` pool ranks: its slowest member's."""
    return speeds.reshape(-1, size).min(axis=1)


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


def even(topology: Topology) -> Topology:
    """`topology` with even ranks (what the speed-blind decisions, such as the step count, are made on)."""
    return topology if topology.rank_speeds is None else replace(topology, rank_speeds=None)


def with_speeds(topology: Topology, speeds: np.ndarray | None, **changes) -> Topology:
    """`replace(topology, **changes)` with `rank_speeds` set to `speeds` (None: even ranks)."""
    return replace(topology, rank_speeds=None if speeds is None else tuple(float(x) for x in speeds), **changes)
