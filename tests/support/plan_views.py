"""Per-step views of a packed epoch (the pieces the planner's packing passes hand each other)."""

from __future__ import annotations

import numpy as np


def step_views(packed: list, u_cost: np.ndarray, u_tok: np.ndarray, topo) -> list:
    """Per step of `packed` (pieces of (units sorted by step and micro-batch, [steps, micro-batches] sizes)):
    (its units sorted, replica times, micro-batch tokens, micro-batch unit counts)."""
    out = []
    for units, sizes in packed:
        start = 0
        for row in sizes:
            seg = units[start : start + row.sum()]
            mb = np.repeat(np.arange(len(row)), row)
            out.append(
                (
                    np.sort(seg),
                    np.bincount(mb // topo.micro_batches, weights=u_cost[seg], minlength=topo.dp),
                    np.bincount(mb, weights=u_tok[seg], minlength=len(row)),
                    row,
                )
            )
            start += row.sum()
    return out
