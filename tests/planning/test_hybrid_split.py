"""The cost-driven choice of a hybrid CP split (balancer.planning.cost.hybrid): never predicted slower than zigzag or
the default hybrid, handed to `CPLayout` as an explicit split, and plan files written before the split became
explicit (layout spec with a cost model) still give the same shares."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import balancer
from attention import CPLayout
from balancer.planning.cost import explicit_layout, hybrid_split
from balancer.planning.cost.microbatch import assignment_terms, rank_times

DATA = Path(__file__).resolve().parent / "data"
METHODS = ("ring", "allgather")
costs = st.builds(
    dict,
    attn_coef=st.floats(1e-9, 1e-7),
    linear_coef=st.floats(0, 1e-5),
    piece_coef=st.floats(0, 1e-3),
    comm_coef=st.floats(0, 1e-5),
    comm_latency=st.floats(0, 1e-3),
    comm_overlap=st.booleans(),
)


def _cu(lens) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)


def _predicted(lay: CPLayout, cost: dict, method: str = "ring") -> float:
    model = balancer.CostModel.from_dict(cost)
    lens = np.diff(lay.cu_seqlens)
    terms = assignment_terms(lens, lay.cp_size, lay.split_docs, np.maximum(lay.doc_rank, 0), model.causal)
    return float(rank_times(model, terms, method).max())


def _chosen(lens, cp: int, cost: dict, method: str = "ring") -> CPLayout:
    split = hybrid_split(lens, cp, cost, method)
    return CPLayout.build(_cu(lens), cp, kind="hybrid", split=np.nonzero(split)[0])


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(2, 300), min_size=1, max_size=12), st.integers(2, 4), costs, st.sampled_from(METHODS))
def test_chosen_split_is_never_predicted_slower_than_zigzag_or_the_default(lens, cp, cost, method):
    """The chosen split's predicted time is at most zigzag's and the default hybrid's, and the explicit spec it
    records (JSON round trip) rebuilds the same layout."""
    lay = _chosen(lens, cp, cost, method)
    mine = _predicted(lay, cost, method)
    cu = _cu(lens)
    for other in (CPLayout.build(cu, cp, kind="hybrid"), CPLayout.build(cu, cp, kind="hybrid", split_threshold=1)):
        assert mine <= _predicted(other, cost, method) * (1 + 1e-12)
    spec = json.loads(json.dumps(lay.layout_spec()))
    assert CPLayout.from_spec(cu, cp, spec).fingerprint() == lay.fingerprint()
    resolved = explicit_layout(lens, cp, {"kind": "hybrid", "cost": cost, "method": method})
    assert resolved["split"] == spec["split"]


def test_chooses_zigzag_where_whole_documents_lose():
    """Three near-equal documents on 2 ranks: with free, overlapped transfers and no per-piece cost the prediction
    says split everything (zigzag's shares). With costly transfers and pieces, the many short documents of an SFT
    batch stay whole (nothing travels)."""
    free_comm = {"attn_coef": 1e-8, "linear_coef": 1e-6}
    lay = _chosen([1000, 999, 998], 2, free_comm)
    zig = CPLayout.build(_cu([1000, 999, 998]), 2)
    assert lay.split_docs.all() and all(np.array_equal(lay.local_indices(r), zig.local_indices(r)) for r in (0, 1))
    sft = np.random.default_rng(0).integers(16, 2000, 60)
    costly = {"attn_coef": 1e-8, "linear_coef": 1e-6, "piece_coef": 1e-4, "comm_coef": 1e-5, "comm_overlap": False}
    assert not hybrid_split(sft, 4, costly).any()


@pytest.mark.parametrize(
    "spec,match",
    [
        ({"cost": {"attn_coef": 1e-8, "linear_coef": 0}, "split_threshold": 5}, "without split_threshold"),
        ({"cost": {"attn_coef": 1e-8, "linear_coef": 0}, "tolerance": 0.1}, "without split_threshold"),
        ({"cost": {"attn_coef": 1e-8, "linear_coef": 0}, "method": "ulysses"}, "method must be"),
        ({"cost": {"attn_coef": 1e-8, "bogus": 1}}, "unknown field"),
        ({"cost": "fast"}, "cost must be"),
        ({"cost": {"attn_coef": 1e-8, "linear_coef": 0}, "kind": "zigzag"}, "cost-driven layout spec"),
    ],
)
def test_cost_spec_bad_values(spec, match):
    with pytest.raises(ValueError, match=match):
        explicit_layout([5, 9, 3], 2, {"kind": "hybrid", **spec})


def test_collator_resolves_a_cost_spec_per_micro_batch():
    """`PackedCollator(layout={"kind": "hybrid", "cost": ...})` shards every micro-batch with the split the planner
    chooses for its documents."""
    import torch

    cost = {"attn_coef": 1e-8, "linear_coef": 1e-6, "piece_coef": 1e-4, "comm_coef": 1e-5, "comm_overlap": False}
    lens = [700, 40, 35, 30, 900, 12]
    items = [{"input_ids": torch.arange(n) % 50} for n in lens]
    for rank in (0, 1):
        out = balancer.PackedCollator(cp_rank=rank, cp_size=2, layout={"kind": "hybrid", "cost": cost})(items)
        assert np.array_equal(out["layout"].split_docs, hybrid_split(lens, 2, cost))


def test_plan_file_from_before_explicit_splits_gives_the_same_shares():
    """A committed plan file written before the change (layout record `{"kind": "hybrid", "cost": ..., "method":
    "ring"}`) loads, and every micro-batch's shares (tokens per CP rank per document) equal the ones the layout code
    of that time derived (recorded beside it)."""
    plan = balancer.Plan.load(DATA / "plan_hybrid_cost_v1.json")
    record = json.loads((DATA / "plan_hybrid_cost_v1.json").read_text())["layout"]
    expected = json.loads((DATA / "plan_hybrid_cost_v1_shares.json").read_text())["micro_batches"]
    cp = plan.topology.cp
    assert len(expected) == plan.num_steps * plan.topology.dp * plan.topology.micro_batches
    splits = 0
    for key, want in expected.items():
        s, r, m = (int(x) for x in key.split("/"))
        mb = plan.steps[s].replicas[r].micro_batches[m]
        lens = [int(plan.lengths[d]) for d in mb.docs] + [e - b for _, b, e in (mb.spans or [])]
        assert lens == want["lengths"]
        spec = explicit_layout(lens, cp, record)
        lay = CPLayout.from_spec(_cu(lens), cp, spec)
        assert lay.seg_len.tolist() == want["seg_len"] and lay.split_docs.tolist() == want["split"]
        splits += sum(want["split"])
    assert 0 < splits < sum(len(w["split"]) for w in expected.values())  # the fixture exercises both kinds


def _shares(plan, k: int, spec: dict) -> list:
    a, b = plan.mb_ptr[k], plan.mb_ptr[k + 1]
    lens = plan.end[a:b] - plan.start[a:b]
    return CPLayout.from_spec(_cu(lens), plan.topology.cp, spec).seg_len.tolist()


@pytest.mark.parametrize("suffix", [".json", ".npz"])
def test_new_plans_record_the_explicit_split_and_round_trip(tmp_path, suffix):
    """`plan.with_layout(cost spec)` records every micro-batch's split set (no cost model in the record); saved and
    loaded (JSON and npz) it gives the same shares as resolving the cost spec; the old file's record resolves the
    same way."""
    old = balancer.Plan.load(DATA / "plan_hybrid_cost_v1.json")
    assert old.layout["cost"] is not None
    new = old.with_layout(old.layout)
    assert set(new.layout) == {"kind", "max_tokens", "splits"} and len(new.layout["splits"]) == len(old.mb_ptr) - 1
    new.save(tmp_path / f"plan{suffix}")
    back = balancer.Plan.load(tmp_path / f"plan{suffix}")
    assert back.layout == new.layout
    for k in range(len(old.mb_ptr) - 1):
        assert _shares(back, k, back.micro_batch_layout(k)) == _shares(old, k, old.micro_batch_layout(k))


def test_layout_record_bad_values(tmp_path):
    plan = balancer.Plan.load(DATA / "plan_hybrid_cost_v1.json")
    n = len(plan.mb_ptr) - 1
    for record, match in [
        ({"kind": "diagonal"}, "field 'layout'"),
        ({"kind": "hybrid", "splits": [[]] * (n - 1)}, "layout.splits"),
        ({"kind": "hybrid", "splits": [[0, 0]] + [[]] * (n - 1)}, r"layout.splits\[0\]"),
        ({"kind": "hybrid", "splits": [[10_000]] + [[]] * (n - 1)}, r"layout.splits\[0\]"),
    ]:
        doc = json.loads((DATA / "plan_hybrid_cost_v1.json").read_text())
        doc["layout"] = record
        (tmp_path / "bad.json").write_text(json.dumps(doc))
        with pytest.raises(ValueError, match=match):
            balancer.Plan.load(tmp_path / "bad.json")


def test_a_plan_without_a_record_is_zigzag():
    topo = balancer.Topology(dp=2, cp=2, micro_batches=2, max_tokens=4096)
    plan = balancer.plan(np.arange(100, 140), topo, balancer.CostModel(attn_coef=1e-9, linear_coef=1e-6))
    assert plan.layout is None and plan.micro_batch_layout(0) == {"kind": "zigzag"}
