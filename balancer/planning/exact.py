"""Exact optimum of one step for small instances, with scipy.optimize.milp (HiGHS).

Used to certify the heuristics: `pack_step`'s step time over the optimum is its optimality gap.

Model (binary x[i, j]: unit i in micro-batch j; micro-batch j belongs to replica j // M):
    minimise T
    sum_j x[i, j] = 1                      every unit exactly once
    1 <= sum_i x[i, j]                     no empty micro-batch
    sum_i tokens_i x[i, j] <= max_tokens*cp
    fixed + sum_i cost_i x[i, j] <= h_r    (only with P > 1) h_r: the replica's largest micro-batch
    (P-1) h_r + sum_{j in r} (fixed + sum_i cost_i x[i, j]) <= T
Symmetry is cut by ordering the micro-batches of a replica by load and pinning the heaviest unit to replica 0.
Times are in cost units; divide by cp for per-rank time (the metrics do).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import lil_matrix

from balancer.planning.cost.model import CostModel
from balancer.planning.metrics import one_f_one_b
from balancer.planning.topology import Topology


@dataclass
class ExactResult:
    assign: np.ndarray  # micro-batch (replica * M + m) of every unit
    step_time: float  # per-CP-rank step time of `assign` (same units as balancer.planning.metrics)
    lower_bound: float  # proven lower bound on the optimum step time
    optimal: bool  # True when the solver proved optimality


def optimal_step(lengths: ArrayLike, topology: Topology, cost: CostModel, time_limit: float = 20.0) -> ExactResult:
    """Optimal assignment of one step's documents (up to ~40) to the topology's micro-batches."""
    lengths = np.asarray(lengths, dtype=np.int64)
    t = topology
    n, nb, m, dp = len(lengths), t.bins_per_step, t.micro_batches, t.dp
    if n < nb:
        raise ValueError(f"{n} documents cannot fill {nb} non-empty micro-batches")
    if n > 60:
        raise ValueError(f"optimal_step is for small instances (<= 60 documents), got {n}")
    if lengths.max() > t.micro_batch_tokens:
        raise ValueError(f"a document of {lengths.max()} tokens exceeds max_tokens*cp = {t.micro_batch_tokens}")
    c = cost.cost(lengths)
    scale = c.max()
    c = c / scale
    fixed = cost.fixed / scale
    nx = n * nb  # variables: x[i, j] at i * nb + j, then h_r (dp of them), then T
    nv = nx + dp + 1
    obj = np.zeros(nv)
    obj[nv - 1] = 1
    lb, ub = np.zeros(nv), np.full(nv, np.inf)
    ub[:nx] = 1
    heaviest = int(np.argmax(c))  # replicas are interchangeable: it sits in replica 0
    ub[[heaviest * nb + j for j in range(m, nb)]] = 0
    integrality = np.zeros(nv)
    integrality[:nx] = 1
    res = milp(
        obj,
        constraints=_constraints(lengths, c, fixed, t),
        integrality=integrality,
        bounds=Bounds(lb, ub),
        options={"time_limit": time_limit, "disp": False},
    )
    if res.x is None:
        raise RuntimeError(f"MILP found no solution: {res.message}")
    assign = np.argmax(res.x[:nx].reshape(n, nb), axis=1)
    per_rep = (np.bincount(assign, weights=c, minlength=nb) + fixed).reshape(dp, m)
    step = float(one_f_one_b(per_rep.max(axis=1), per_rep.sum(axis=1), t.pp).max()) * scale / t.cp
    bound = getattr(res, "mip_dual_bound", None)
    bound = float(bound) * scale / t.cp if bound is not None and np.isfinite(bound) else step
    return ExactResult(assign=assign, step_time=step, lower_bound=min(bound, step), optimal=res.status == 0)


def _constraints(lengths: np.ndarray, c: np.ndarray, fixed: float, t: Topology) -> LinearConstraint:
    """The rows of the module docstring's model over the variables of `optimal_step` (costs scaled to max 1)."""
    n, nb, m, dp = len(lengths), t.bins_per_step, t.micro_batches, t.dp
    nx = n * nb
    ih, it = nx, nx + dp  # h_r, T
    xi = lambda i, j: i * nb + j  # noqa: E731
    lo: list[float] = []
    hi: list[float] = []
    a = lil_matrix((n + 3 * nb + dp + nb, nx + dp + 1))
    r = 0
    for i in range(n):  # exactly once
        for j in range(nb):
            a[r, xi(i, j)] = 1
        lo.append(1)
        hi.append(1)
        r += 1
    for j in range(nb):  # non-empty, token cap
        for i in range(n):
            a[r, xi(i, j)] = 1
            a[r + 1, xi(i, j)] = lengths[i]
        lo += [1, -np.inf]
        hi += [np.inf, t.micro_batch_tokens]
        r += 2
    for j in range(nb):  # load_j <= h_r
        for i in range(n):
            a[r, xi(i, j)] = c[i]
        a[r, ih + j // m] = -1
        lo.append(-np.inf)
        hi.append(-fixed)
        r += 1
    for rep in range(dp):  # (P-1) h_r + sum loads <= T
        for j in range(rep * m, (rep + 1) * m):
            for i in range(n):
                a[r, xi(i, j)] = c[i]
        a[r, ih + rep] = t.pp - 1
        a[r, it] = -1
        lo.append(-np.inf)
        hi.append(-m * fixed)
        r += 1
    for j in range(nb):  # symmetry: loads non-increasing inside a replica
        if j % m == m - 1:
            continue
        for i in range(n):
            a[r, xi(i, j)] = c[i]
            a[r, xi(i, j + 1)] = -c[i]
        lo.append(0)
        hi.append(np.inf)
        r += 1
    return LinearConstraint(a[:r].tocsr(), lo, hi)
