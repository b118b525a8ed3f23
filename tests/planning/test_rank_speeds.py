"""Uneven ranks (`Topology.rank_speeds`): validation, metrics and bounds, plan files."""

import dataclasses
import json

import numpy as np
import pytest

import balancer
from balancer import CostModel, Plan, Topology
from balancer.planning import metrics

LINEAR = CostModel(attn_coef=0.0, linear_coef=1.0)


@pytest.mark.parametrize(
    "speeds, needle",
    [
        ((1.0, 2.0, 3.0), "has 3 entries, but needs one per DP replica (dp = 4)"),
        ((1.0, 1.0, 0.0, 1.0), "rank_speeds[2] = 0.0: speeds must be positive finite numbers"),
        ((1.0, -1.0, 1.0, 1.0), "rank_speeds[1] = -1.0: speeds must be positive"),
        ((1.0, float("nan"), 1.0, 1.0), "rank_speeds[1] = nan"),
        ((1.0, float("inf"), 1.0, 1.0), "rank_speeds[1] = inf"),
        ((1.0, True, 1.0, 1.0), "rank_speeds[1] = True is not a number"),
        ((1.0, "2", 1.0, 1.0), "rank_speeds[1] = '2' is not a number"),
        ("1111", "must be a sequence of relative speeds"),
        (2.0, "must be a sequence of relative speeds"),
    ],
)
def test_bad_speeds_are_refused_naming_the_argument(speeds, needle):
    with pytest.raises(ValueError) as err:
        Topology(dp=4, rank_speeds=speeds)
    assert "Topology.rank_speeds" in str(err.value) and needle in str(err.value), str(err.value)


def test_speeds_are_floats_one_per_replica_or_pool_rank():
    assert Topology(dp=2, rank_speeds=[1, np.float32(2.5)]).rank_speeds == (1.0, 2.5)
    assert Topology(dp=2, cp=2, cp_sizes=(1, 2), rank_speeds=(1, 1, 2, 2)).rank_speeds == (1.0, 1.0, 2.0, 2.0)
    with pytest.raises(ValueError, match=r"one per pool rank \(dp\*cp = 4\)"):
        Topology(dp=2, cp=2, cp_sizes=(1, 2), rank_speeds=(1, 2))
    assert "rank_speeds" not in Topology(dp=2).to_dict()
    topo = Topology(dp=2, rank_speeds=(1, 3))
    assert Topology.from_dict(topo.to_dict()) == topo and "rank_speeds=[1.0, 3.0]" in str(topo)


def test_metrics_by_hand_with_speeds():
    # dp=2, pp=2, M=2, cp=2; replica 1 twice as fast
    topo = Topology(dp=2, cp=2, pp=2, micro_batches=2, max_tokens=100, tokens_per_step=100, rank_speeds=(1.0, 2.0))
    lengths = [40, 10, 20, 30]
    plan = Plan.from_micro_batches([[[[0], [1]], [[2], [3]]]], lengths, topo, LINEAR)
    # replica 0: (20, 5) -> (2-1)*20 + 25 = 45; replica 1: (10, 15) -> 15 + 25 = 40, / 2 = 20
    assert metrics.replica_times(plan.micro_batch_costs(), topo).tolist() == [[45.0, 20.0]]
    m = plan.metrics()
    lb = max(100 / (2 * 3.0) * (1 + 1 / 2), 2 * 40 / (2 * 2.0))
    assert m["imbalance"] == pytest.approx(45.0 / lb) and m["epoch_efficiency"] == pytest.approx(lb / 45.0)
    assert m["rank_speeds"] == [1.0, 2.0]
    even = Plan.from_micro_batches(
        [[[[0], [1]], [[2], [3]]]], lengths, dataclasses.replace(topo, rank_speeds=None), LINEAR
    )
    assert "rank_speeds" not in even.metrics()


def test_bounds_reduce_to_the_even_formula():
    topo = Topology(dp=4, cp=2, pp=3, micro_batches=4, max_tokens=100)
    work, largest = np.array([800.0, 50.0]), np.array([30.0, 40.0])
    even = metrics.lower_bound(work, largest, topo, fixed=2.0)
    ones = metrics.lower_bound(work, largest, dataclasses.replace(topo, rank_speeds=(1,) * 4), fixed=2.0)
    assert np.array_equal(even, ones)
    doubled = metrics.lower_bound(work, largest, dataclasses.replace(topo, rank_speeds=(2,) * 4), fixed=2.0)
    assert np.allclose(doubled, even / 2)
    mixed = dataclasses.replace(topo, rank_speeds=(1, 1, 1, 3))
    want = np.maximum((work + 2.0 * 16) / (2 * 6) * (1 + 2 / 4), 3 * (largest + 2.0) / (2 * 3))
    assert np.allclose(metrics.lower_bound(work, largest, mixed, fixed=2.0), want)


def test_dynamic_group_runs_at_its_slowest_member():
    topo = Topology(dp=2, cp=2, micro_batches=1, max_tokens=100, cp_sizes=(1, 2, 4), rank_speeds=(1, 2, 4, 4))
    # one slot: a group of ranks [0, 2) (cost 8, speed min(1, 2) = 1) and two single ranks (cost 8 each, speed 4)
    times = metrics.dynamic_step_times(
        np.array([8.0, 8.0, 8.0]), np.array([0, 2, 3]), np.array([2, 1, 1]), np.array([0, 3]), topo
    )
    assert times.tolist() == [4.0]
    faster = dataclasses.replace(topo, rank_speeds=(2, 2, 1, 1))
    assert metrics.dynamic_step_times(
        np.array([8.0, 8.0, 8.0]), np.array([0, 2, 3]), np.array([2, 1, 1]), np.array([0, 3]), faster
    ).tolist() == [8.0]
    # the dynamic bound: W / sum(s) and P * max cost / (C * max(s))
    assert metrics.lower_bound(24.0, 8.0, topo).item() == max(24.0 / 11, 8.0 / (4 * 4))


def _speed_plan():
    lengths = np.random.default_rng(1).integers(1, 900, 120)
    topo = Topology(dp=3, cp=1, micro_batches=2, max_tokens=1024)
    base = balancer.plan(lengths, topo, LINEAR, seed=0)
    fast = dataclasses.replace(topo, rank_speeds=(1.0, 1.5, 0.5))
    return Plan(base.lengths, fast, LINEAR, base.doc, base.start, base.end, base.mb_ptr, seed=0), base


@pytest.mark.parametrize("suffix", [".json", ".npz"])
def test_plan_files_carry_the_speeds(tmp_path, suffix):
    plan, base = _speed_plan()
    plan.save(tmp_path / f"p{suffix}")
    back = Plan.load(tmp_path / f"p{suffix}")
    assert back.topology.rank_speeds == (1.0, 1.5, 0.5)
    assert back.metrics()["imbalance"] == plan.metrics()["imbalance"]
    base.save(tmp_path / f"even{suffix}")
    assert Plan.load(tmp_path / f"even{suffix}").topology.rank_speeds is None


def test_plan_files_without_speeds_keep_version_3(tmp_path):
    plan, base = _speed_plan()
    base.save(tmp_path / "even.json")
    data = json.loads((tmp_path / "even.json").read_text())
    assert data["format_version"] == 3 and "rank_speeds" not in data["topology"]
    plan.save(tmp_path / "fast.json")
    data = json.loads((tmp_path / "fast.json").read_text())
    assert data["format_version"] == 4 and data["topology"]["rank_speeds"] == [1.0, 1.5, 0.5]
    data["format_version"] = 3  # a version-3 file cannot hold speeds
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"topology.rank_speeds.: not part of format_version 3 \(added in 4\)"):
        Plan.load(tmp_path / "bad.json")
    data["format_version"] = 4
    data["topology"]["rank_speeds"] = [1.0, 0.0, 1.0]
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"field 'topology': Topology.rank_speeds\[1\] = 0.0"):
        Plan.load(tmp_path / "bad.json")
    data["topology"]["rank_speeds"] = [1.0, 1.0]
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"has 2 entries, but needs one per DP replica"):
        Plan.load(tmp_path / "bad.json")


def test_token_bound_when_the_fast_replica_cannot_hold_its_share(caplog):
    """A step budget near capacity leaves a 3x-faster replica no room for its half of the work: token_bound says so
    (asked, held, the budget with room) and the planner logs it once; with slack it is None and nothing is logged."""
    import logging

    from balancer.planning.speeds import token_bound

    speeds = (2.0, 2 / 3, 2 / 3, 2 / 3)
    full = Topology(dp=4, micro_batches=2, max_tokens=1024, tokens_per_step=6963, rank_speeds=speeds)
    assert token_bound(full) == (3481, 2048, 3686)
    room = dataclasses.replace(full, tokens_per_step=3600)
    assert token_bound(room) is None
    assert token_bound(dataclasses.replace(full, rank_speeds=None)) is None
    assert token_bound(dataclasses.replace(full, rank_speeds=(1.0,) * 4)) is None
    lengths = np.random.default_rng(0).integers(10, 400, 600)
    with caplog.at_level(logging.INFO, logger="balancer.planning.planner"):
        balancer.plan(lengths, room, LINEAR, seed=0)
        assert "tokens_per_step is lowered" not in caplog.text
        balancer.plan(lengths, full, LINEAR, seed=0)
    assert "share of a step is about 3481 tokens, but a replica holds 2048" in caplog.text
    assert "(to about 3686)" in caplog.text
