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


# ---- a plan file is untrusted input: every lie is one clear error naming the file and the field -----------------
def _small_plan():
    lengths = np.random.default_rng(1).integers(1, 500, 60)
    return balancer.plan(lengths, Topology(dp=2, micro_batches=2, max_tokens=1024), COST, seed=0)


def _tamper_json(tmp_path, edit):
    path = tmp_path / "p.json"
    _small_plan().save(path)
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda d: d["steps"][0]["replicas"][0]["micro_batches"][0]["docs"].__setitem__(0, -1), "docs"),
        (lambda d: d["steps"][0]["replicas"][0]["micro_batches"][0]["docs"].__setitem__(0, 10**6), "docs"),
        (lambda d: d["steps"][0]["replicas"][0]["micro_batches"][0]["docs"].__setitem__(0, "3"), "docs"),
        (lambda d: d["steps"][0]["replicas"][0]["micro_batches"][0].__setitem__("spans", [[1, 2]]), "spans"),
        (lambda d: d["steps"][0].__setitem__("replicas", 7), "replicas"),
        (lambda d: d.__setitem__("steps", {"a": 1}), "steps"),
        (lambda d: d["topology"].__setitem__("dp", "two"), "topology"),
        (lambda d: d["cost_model"].pop("attn_coef"), "cost_model"),
        (lambda d: d.__setitem__("num_docs", 3), "num_docs"),
        (lambda d: d.__setitem__("seed", [1]), "seed"),
        (lambda d: d["lengths"].__setitem__(0, -5), "lengths"),
        (
            lambda d: d["steps"][0]["replicas"][0]["micro_batches"][0]["docs"].append(
                d["steps"][0]["replicas"][0]["micro_batches"][1]["docs"][0]
            ),
            "overlapping|max_tokens",
        ),
    ],
)
def test_load_rejects_lying_json(tmp_path, edit, field):
    path = _tamper_json(tmp_path, edit)
    with pytest.raises(ValueError, match=field) as err:
        Plan.load(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize(
    "changes, field",
    [
        (lambda a: {"mb_ptr": a["mb_ptr"][::-1].copy()}, "mb_ptr"),
        (lambda a: {"doc": np.where(np.arange(len(a["doc"])) == 0, -1, a["doc"])}, "doc"),
        (lambda a: {"doc": a["doc"].astype(np.float64)}, "doc"),
        (lambda a: {"start": a["start"][:-1]}, "start"),
        (lambda a: {"mb_ptr": None}, "mb_ptr"),
        (lambda a: {"header": np.frombuffer(b"{bad", dtype=np.uint8)}, "header"),
    ],
)
def test_load_rejects_lying_npz(tmp_path, changes, field):
    path = _tamper_npz(tmp_path, changes)
    with pytest.raises(ValueError, match=field) as err:
        Plan.load(path)
    assert str(path) in str(err.value)


def _tamper_npz(tmp_path, changes):
    path = tmp_path / "p.npz"
    _small_plan().save(path)
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    for key, value in changes(arrays).items():
        if value is None:
            del arrays[key]
        else:
            arrays[key] = value
    np.savez(path, **arrays)
    return path


@pytest.mark.parametrize("suffix", [".json", ".npz"])
def test_load_against_other_lengths(tmp_path, suffix):
    path = tmp_path / f"p{suffix}"
    plan = _small_plan()
    plan.save(path)
    other = plan.lengths.copy()
    other[3] += 1
    with pytest.raises(ValueError, match="other lengths") as err:
        Plan.load(path, lengths=other)
    assert str(path) in str(err.value)
    assert np.array_equal(Plan.load(path, lengths=plan.lengths).doc, plan.doc)


def test_load_validate_opt_out(tmp_path):
    def edit(d):  # a document placed twice: only the invariant check sees it
        mbs = d["steps"][0]["replicas"][0]["micro_batches"]
        mbs[0]["docs"].append(mbs[1]["docs"][0])

    path = _tamper_json(tmp_path, edit)
    with pytest.raises(ValueError, match="overlapping|max_tokens"):
        Plan.load(path)
    assert Plan.load(path, validate=False).num_docs == 60
