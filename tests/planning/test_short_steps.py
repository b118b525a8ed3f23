"""A short last step: fixed-length rows (or too few documents) that cannot fill every step's dp*micro_batches
micro-batches plan with default flags, the last step of the epoch (or of a window) running M' < micro_batches
micro-batches on every replica, recorded in the plan, its files and every consumer; rows no M' splits equally over
the replicas are refused naming the numbers."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import balancer
from balancer.planning.shuffle import num_windows
from balancer.planning.steps import ShortStepError

COST = balancer.CostModel(attn_coef=1e-3, linear_coef=1.0)


@st.composite
def awkward_rows(draw):
    """Fixed-length rows of counts that often leave a short last step."""
    dp, m, cp, pp = draw(st.integers(1, 4)), draw(st.integers(2, 4)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    row = draw(st.integers(1, 300))
    per_mb = draw(st.sampled_from([1, 1, 2]))
    max_tokens = -(-row * per_mb // cp)
    n = draw(st.integers(1, 12 * dp * m))
    return np.full(n, row), balancer.Topology(dp=dp, cp=cp, pp=pp, micro_batches=m, max_tokens=max_tokens)


def _step_shapes(plan) -> list[np.ndarray]:
    """[dp, micro-batches] document counts of every step, read from the flat layout."""
    t, counts = plan.topology, np.diff(plan.mb_ptr)
    out, first = [], 0
    for s in range(plan.num_steps):
        ms = plan.step_micro_batches(s)
        out.append(counts[first : first + t.dp * ms].reshape(t.dp, ms))
        first += t.dp * ms
    assert first == len(counts)
    return out


def _check_plan(plan, n: int) -> None:
    t = plan.topology
    plan.validate()
    assert sorted(plan.doc.tolist()) == list(range(n))  # every row exactly once
    shapes = _step_shapes(plan)
    assert all(s.min() >= 1 for s in shapes)  # none empty
    assert all(s.shape == (t.dp, t.micro_batches) for s in shapes[:-1])  # only the last step may be short
    assert shapes[-1].shape == (t.dp, plan.last_micro_batches)
    assert [len(r.micro_batches) for r in plan.steps[-1].replicas] == [plan.last_micro_batches] * t.dp
    assert plan.micro_batch_counts().tolist() == [t.micro_batches] * (plan.num_steps - 1) + [plan.last_micro_batches]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(awkward_rows(), st.integers(0, 5))
def test_rows_of_any_count_plan_or_are_refused_by_name(inst, seed):
    lengths, topo = inst
    n = len(lengths)
    try:
        plan = balancer.plan(lengths, topo, COST, seed=seed)
    except ShortStepError as e:
        message = str(e)
        assert f"{n} " in message and f"dp = {topo.dp}" in message and "Topology.dp" in message, message
        assert e.missing >= 1
        # the missing rows make it plan: nothing was refused that a split exists for
        _check_plan(balancer.plan(np.full(n + e.missing, lengths[0]), topo, COST, seed=seed), n + e.missing)
        return
    _check_plan(plan, n)
    t_step = plan.step_times()
    m = plan.metrics()
    assert np.all(np.isfinite(t_step)) and m["imbalance"] >= 1 - 1e-9 and m["epoch_efficiency"] <= 1 + 1e-9


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(awkward_rows())
def test_short_plans_round_trip_through_files(tmp_path_factory, inst):
    lengths, topo = inst
    try:
        plan = balancer.plan(lengths, topo, COST)
    except ShortStepError:
        return
    folder = tmp_path_factory.mktemp("plans")
    for name in ("p.json", "p.npz"):
        plan.save(folder / name)
        back = balancer.Plan.load(folder / name)
        assert back.last_micro_batches == plan.last_micro_batches and back.num_steps == plan.num_steps
        assert np.array_equal(back.doc, plan.doc) and np.array_equal(back.mb_ptr, plan.mb_ptr)
        assert back.metrics()["imbalance"] == pytest.approx(plan.metrics()["imbalance"])
    head = json.loads((folder / "p.json").read_text())
    short = plan.last_micro_batches < topo.micro_batches
    assert ("last_micro_batches" in head) == short and head["format_version"] == (5 if short else 3)


def test_the_reported_example_plans():
    """1,001 rows of max_tokens each on dp 4 x 2 micro-batches: 1,001 = 125 * 8 + 1 cannot be split over 4
    replicas (refused, naming 3 rows more); 1,004 plans with a last step of one micro-batch per replica."""
    topo = balancer.Topology(dp=4, micro_batches=2, max_tokens=512)
    with pytest.raises(ShortStepError, match=r"1001 rows of 512 tokens .*dp = 4 .*leave 1 rows.*3 rows more") as e:
        balancer.plan(np.full(1001, 512), topo, COST)
    assert "\n" not in str(e.value) and e.value.missing == 3
    plan = balancer.plan(np.full(1004, 512), topo, COST)
    assert (plan.num_steps, plan.last_micro_batches) == (126, 1)
    _check_plan(plan, 1004)


def test_lower_bound_of_a_short_step_uses_its_micro_batches():
    """pp 2: the short step's bound is W/(dp*cp) * (1 + (P-1)/M') and `fixed` counts M' micro-batches there."""
    cost = balancer.CostModel(attn_coef=0.0, linear_coef=1.0, fixed=5.0)
    topo = balancer.Topology(dp=2, pp=2, micro_batches=3, max_tokens=10)
    plan = balancer.plan(np.full(8, 10), topo, cost)  # one full step of 6 rows, a last one of 2 (M' = 1)
    assert (plan.num_steps, plan.last_micro_batches) == (2, 1)
    bounds = balancer.planning.lower_bound([60.0, 20.0], [10.0, 10.0], topo, 5.0, micro_batches=[3, 1])
    assert bounds[1] == pytest.approx(max((20 + 5 * 2 * 1) / 2 * (1 + 1 / 1), 2 * 15))
    assert bounds[0] == pytest.approx(max((60 + 5 * 2 * 3) / 2 * (1 + 1 / 3), 2 * 15))
    # each replica of the last step runs one micro-batch of 10 tokens + fixed: 1F1B time (P-1)*15 + 15 = 30
    assert plan.step_times()[1] == pytest.approx(30.0)
    m = plan.metrics()
    assert m["imbalance"] == pytest.approx(plan.step_times().sum() / bounds.sum())


def test_too_few_documents_of_any_lengths_make_one_short_step():
    topo = balancer.Topology(dp=2, micro_batches=4, max_tokens=4096, pp=2)
    plan = balancer.plan([100, 200, 3000, 50, 700], topo, COST)
    assert (plan.num_steps, plan.last_micro_batches) == (1, 2)
    _check_plan(plan, 5)
    few = r"2 documents cannot fill .*nor one on each of dp = 4 replicas.*\(Topology.dp to at most 2\)"
    with pytest.raises(ValueError, match=few):
        balancer.plan([100, 200], balancer.Topology(dp=4, micro_batches=2, max_tokens=4096), COST)
    with pytest.raises(ValueError, match=r"1 rows of 100 tokens cannot give each of dp = 2 replicas .*at most 1"):
        balancer.plan([100], topo, COST)


def test_windows_of_rows_end_in_a_short_step_and_cover_every_row_once():
    topo = balancer.Topology(dp=4, micro_batches=2, max_tokens=64)
    lengths = np.full(1000, 64)
    k = num_windows(1000, 500)
    seen = []
    for index in range(k):
        p = balancer.plan_window(lengths, topo, COST, seed=3, epoch=1, index=index, window_docs=500)
        p.validate()
        assert p.last_micro_batches == 1  # 500 = 62 * 8 + 4 rows: one micro-batch per replica in the last step
        seen += p.doc.tolist()
    assert sorted(seen) == list(range(1000))


def test_old_plan_files_load_and_a_short_step_needs_version_5(tmp_path):
    full = balancer.plan(np.full(16, 8), balancer.Topology(dp=2, micro_batches=2, max_tokens=8), COST)
    full.save(tmp_path / "full.json")
    assert json.loads((tmp_path / "full.json").read_text())["format_version"] == 3  # unchanged for old readers
    assert balancer.Plan.load(tmp_path / "full.json").last_micro_batches == 2
    short = balancer.plan(np.full(18, 8), balancer.Topology(dp=2, micro_batches=2, max_tokens=8), COST)
    short.save(tmp_path / "short.json")
    data = json.loads((tmp_path / "short.json").read_text())
    assert data["last_micro_batches"] == 1 and len(data["steps"][-1]["replicas"][0]["micro_batches"]) == 1
    for edit, match in (
        (lambda d: d.__setitem__("format_version", 4), "last_micro_batches"),
        (lambda d: d.__setitem__("last_micro_batches", 3), "last_micro_batches"),
        (lambda d: d.pop("last_micro_batches"), "micro_batches"),
        (lambda d: d["steps"][-1]["replicas"][1]["micro_batches"].append({"docs": [0]}), "micro_batches"),
    ):
        bad = json.loads(json.dumps(data))
        edit(bad)
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=match):
            balancer.Plan.load(tmp_path / "bad.json")


def test_plan_constructor_checks_last_micro_batches():
    p = balancer.plan(np.full(18, 8), balancer.Topology(dp=2, micro_batches=2, max_tokens=8), COST)
    args = (p.lengths, p.topology, p.cost_model, p.doc, p.start, p.end, p.mb_ptr)
    with pytest.raises(ValueError, match="not steps of dp\\*M = 4"):
        balancer.Plan(*args)
    with pytest.raises(ValueError, match="last_micro_batches must be an integer in 1..micro_batches = 2"):
        balancer.Plan(*args, last_micro_batches=0)
    assert balancer.Plan(*args, last_micro_batches=1).num_steps == 5


@pytest.mark.parametrize("n, sizes, cp", [(12, (1,), 1), (3, (1, 2), 2), (20, (1,), 1)])
def test_dynamic_cp_plans_a_short_last_step(n, sizes, cp):
    """Dynamic CP cuts the short last step on its own: M' slots, each a partition of the pool, every row once, and
    the pool ranks' samplers yield the same count, len() exact."""
    topo = balancer.Topology(dp=4 // cp, cp=cp, micro_batches=2, max_tokens=64, cp_sizes=sizes)
    plan = balancer.plan(np.full(n, 64), topo, COST)
    plan.validate()
    assert plan.last_micro_batches < 2 and len(plan.steps[-1].slots) == plan.last_micro_batches
    assert sorted(plan.doc.tolist()) == list(range(n))
    assert np.isfinite(plan.metrics()["imbalance"])
    samplers = [balancer.BalancedBatchSampler(np.full(n, 64), topo, COST, rank=r) for r in range(4)]
    out = [list(s) for s in samplers]
    assert {len(o) for o in out} == {len(samplers[0])} == {2 * (plan.num_steps - 1) + plan.last_micro_batches}
    assert {int(i) for o in out for mb in o for i in mb} == set(range(n))


def test_predict_runs_over_a_short_last_step():
    cost = balancer.CostModel.from_model(
        hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=512, vocab_size=1000,
        hardware="h100-nvlink",
    )  # fmt: skip
    topo = balancer.Topology(dp=2, cp=2, micro_batches=2, max_tokens=256)
    plan = balancer.plan(np.full(10, 512), topo, cost)  # steps of 4 rows, 4 rows and a last one of 2 (M' = 1)
    assert (plan.num_steps, plan.last_micro_batches) == (3, 1)
    report = plan.predict()
    assert report["micro_batch_times"].shape == (3, 2, 2) and np.all(report["micro_batch_times"][-1, :, 1] == 0)
    assert report["compute_only_total"] == pytest.approx(plan.step_times().sum())
