import numpy as np
import pytest

from balancer import CostModel, Plan, Topology
from balancer.planning import metrics


def test_metrics_by_hand_pipeline():
    # dp=2, cp=2, pp=3, M=2; cost = tokens (linear only); one step
    topo = Topology(dp=2, cp=2, pp=3, micro_batches=2, max_tokens=100, tokens_per_step=100)
    cost = CostModel(attn_coef=0.0, linear_coef=1.0)
    lengths = [40, 10, 20, 30, 5]
    plan = Plan.from_micro_batches([[[[0], [1]], [[2, 4], [3]]]], lengths, topo, cost)
    m = plan.metrics()
    # replica 0: t = 40/2, 10/2 -> (3-1)*20 + 25 = 65; replica 1: 25/2, 30/2 -> 2*15 + 27.5 = 57.5
    t_step = 65.0
    w = 105.0
    lb = max(w / 4 * (1 + 2 / 2), 3 * 40 / 2)
    assert m["imbalance"] == pytest.approx(t_step / lb)
    assert m["worst_step"] == pytest.approx(t_step / lb)
    assert m["epoch_efficiency"] == pytest.approx(lb / t_step)
    assert m["token_utilization"] == pytest.approx(105 / 800)
    assert m["dropped_tokens"] == 0 and m["padding_tokens"] == 0


def test_replica_and_step_times_shapes():
    topo = Topology(dp=2, pp=2, micro_batches=3, max_tokens=10)
    mb = np.arange(12, dtype=float).reshape(2, 2, 3)
    r = metrics.replica_times(mb, topo)
    assert r.shape == (2, 2)
    assert r[0, 0] == 2 + (0 + 1 + 2)
    assert metrics.step_times(mb, topo).tolist() == [r[0].max(), r[1].max()]


def test_natural_steps():
    order = np.array([2, 0, 1])
    lengths = np.array([5, 5, 10])
    nat = metrics.natural_steps(order, lengths, 10)
    assert nat.tolist() == [1, 1, 0]
