"""Which replica runs which of a step's packed shares: a seeded permutation per step (even ranks).

The packers fill a step's replicas in a fixed order (heavy units first), so without it the same replica gets the
step's longest documents step after step: with a cost model that misjudges long documents it is the straggler of
every step, and a fit of per-replica speeds from measurements (balancer.measured) cannot tell its speed from the
cost of its work (on the measured benchmark's even windows the fast rank's speed came out at 2.6x instead of 3x).
Swapping whole replica shares within a step changes no step time, token count or metric; with uneven rank speeds
the shares are sized to their replicas and stay where they are.
"""

from __future__ import annotations

import numpy as np

from balancer.planning.speeds import uneven
from balancer.planning.topology import Topology


def permute_replicas(packed: list, topology: Topology, rng: np.random.Generator) -> list:
    """`packed` (pieces of (units in micro-batch order, [steps, dp * M] micro-batch sizes)) with every step's
    replica blocks of M micro-batches in a permutation drawn from `rng`, one per step in order (deterministic for a
    seed). Unchanged for dp = 1 and uneven rank speeds."""
    dp, m = topology.dp, topology.micro_batches
    if dp == 1 or uneven(topology):
        return packed
    out = []
    for positions, sizes in packed:
        steps = len(sizes)
        perm = np.argsort(rng.random((steps, dp)), axis=1)  # [steps, dp]: the new block j is the old perm[s, j]
        bins = (perm[:, :, None] * m + np.arange(m)).reshape(steps, dp * m)  # old bin of every new bin
        old_flat = (bins + np.arange(steps)[:, None] * dp * m).ravel()
        starts = np.concatenate([[0], np.cumsum(sizes.ravel())])[:-1]
        flat_sizes = sizes.ravel()[old_flat]
        take = np.repeat(starts[old_flat] - np.concatenate([[0], np.cumsum(flat_sizes)])[:-1], flat_sizes)
        take += np.arange(len(take))
        out.append((positions[take], flat_sizes.reshape(steps, dp * m)))
    return out
