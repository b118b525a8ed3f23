import json

import numpy as np
import pytest

import balancer
from balancer import CostModel, Plan, Topology

COST = CostModel(attn_coef=2 / 53000, linear_coef=1.0, fixed=3.0)


@pytest.fixture(scope="module")
def plan():
    lengths = np.random.default_rng(0).integers(1, 3000, 3000)
    lengths[5] = 20000
    topo = Topology(dp=2, cp=2, pp=2, micro_batches=3, max_tokens=4096)
    return balancer.plan(lengths, topo, COST, seed=7, overflow="split")


@pytest.mark.parametrize("suffix", [".json", ".npz"])
def test_round_trip(plan, tmp_path, suffix):
    path = tmp_path / f"plan{suffix}"
    plan.save(path)
    back = Plan.load(path)
    for name in ("doc", "start", "end", "mb_ptr", "lengths"):
        assert np.array_equal(getattr(back, name), getattr(plan, name)), name
    assert back.topology == plan.topology and back.cost_model == plan.cost_model
    m1, m2 = plan.metrics(), back.metrics()
    for k in ("imbalance", "worst_step", "epoch_efficiency", "token_utilization", "dropped_tokens", "steps"):
        assert m1[k] == pytest.approx(m2[k]), k
    back.validate()


def test_json_layout_documented_fields(plan, tmp_path):
    path = tmp_path / "p.json"
    plan.save(path)
    data = json.loads(path.read_text())
    assert {"topology", "cost_model", "num_docs", "steps"} <= set(data)
    assert data["num_docs"] == plan.num_docs
    step = data["steps"][0]
    assert len(step["replicas"]) == 2 and len(step["replicas"][0]["micro_batches"]) == 3
    spans = [
        s for st in data["steps"] for r in st["replicas"] for mb in r["micro_batches"] for s in mb.get("spans", [])
    ]
    assert sorted(map(tuple, spans)) == [(5, 0, 8192), (5, 8192, 16384), (5, 16384, 20000)]
    ids = [d for st in data["steps"] for r in st["replicas"] for mb in r["micro_batches"] for d in mb["docs"]]
    assert sorted(ids + [5]) == list(range(plan.num_docs))


def test_views_agree(plan):
    s = plan.steps[1]
    for r in range(2):
        view = plan.rank_view(r)[1]
        assert [mb.ids for mb in s.replicas[r].micro_batches] == view


def test_validate_catches_corruption(plan):
    doc = plan.doc.copy()
    doc[0] = doc[1]
    broken = Plan(
        plan.lengths,
        plan.topology,
        plan.cost_model,
        doc,
        plan.start,
        np.where(np.arange(len(doc)) == 0, plan.lengths[doc[1]], plan.end),
        plan.mb_ptr,
    )
    with pytest.raises(ValueError):
        broken.validate()


def test_load_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a plan JSON"):
        Plan.load(bad)
    bad.write_text("{}")
    with pytest.raises(ValueError, match="no 'topology'"):
        Plan.load(bad)
