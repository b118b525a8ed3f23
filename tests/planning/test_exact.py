"""The heuristic against the MILP optimum on small random steps."""

import numpy as np
import pytest

from balancer import CostModel, Topology
from balancer.planning import metrics
from balancer.planning.exact import optimal_step
from balancer.planning.packing import pack_step

COST = CostModel(attn_coef=2 / 53000, linear_coef=1.0)


def heuristic_step_time(lengths, topo):
    c = COST.cost(lengths)
    assign = pack_step(c, lengths, topo)
    assert np.all(assign >= 0)
    mb = np.bincount(assign, weights=c, minlength=topo.bins_per_step)
    return float(metrics.step_times(mb.reshape(1, topo.dp, topo.micro_batches), topo)[0])


@pytest.mark.slow  # MILP solves: up to ~20 s
@pytest.mark.parametrize("dp, pp, m", [(2, 1, 2), (3, 1, 2), (2, 2, 2), (2, 4, 3)])
def test_gap_to_optimum_small_instances(dp, pp, m):
    rng = np.random.default_rng(dp * 100 + pp * 10 + m)
    gaps = []
    for _ in range(4):
        n = int(rng.integers(dp * m + 2, 18))
        lengths = np.minimum((rng.pareto(1.1, n) + 1) * 1500, 60000).astype(np.int64)
        topo = Topology(dp=dp, cp=2, pp=pp, micro_batches=m, max_tokens=32768)
        exact = optimal_step(lengths, topo, COST, time_limit=20)
        heur = heuristic_step_time(lengths, topo)
        lb = metrics.lower_bound(COST.cost(lengths).sum(), COST.cost(lengths).max(), topo)
        assert exact.lower_bound >= lb * (1 - 1e-9)  # the MILP respects the analytic bound
        assert heur >= exact.lower_bound * (1 - 1e-6)  # nothing beats a proven optimum
        gaps.append(heur / exact.step_time)
    assert max(gaps) <= 1.05, gaps
    assert np.mean(gaps) <= 1.02, gaps


def test_exact_rejects_big_or_infeasible():
    topo = Topology(dp=2, micro_batches=2, max_tokens=100)
    with pytest.raises(ValueError, match="cannot fill"):
        optimal_step([1, 2, 3], topo, COST)
    with pytest.raises(ValueError, match="small instances"):
        optimal_step(np.ones(100, dtype=int), topo, COST)
    with pytest.raises(ValueError, match="exceeds"):
        optimal_step([1, 2, 3, 500], topo, COST)
