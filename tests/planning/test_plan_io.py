import json

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

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
    with pytest.raises(ValueError, match="bad.json: invalid JSON at line 1"):
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
            "overlap|max_tokens",
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
    with pytest.raises(ValueError, match="overlap|max_tokens"):
        Plan.load(path)
    assert Plan.load(path, validate=False).num_docs == 60


# ---- coverage, nesting, format versions, damaged .npz (issue 20) ------------------------------------------------
def _split_plan():
    lengths = np.random.default_rng(2).integers(1, 400, 40)
    lengths[7] = 2500  # split into windows of 1024
    return balancer.plan(lengths, Topology(dp=2, micro_batches=3, max_tokens=1024), COST, seed=0, overflow="split")


def _spans_of(data, doc):
    return [
        (s, r, m, i)
        for s, st in enumerate(data["steps"])
        for r, rep in enumerate(st["replicas"])
        for m, mb in enumerate(rep["micro_batches"])
        for i, span in enumerate(mb.get("spans", []))
        if span[0] == doc
    ]


def _save_json(plan, tmp_path) -> tuple:
    path = tmp_path / "p.json"
    plan.save(path)
    return path, json.loads(path.read_text())


@pytest.mark.parametrize("damage", ["shorten", "drop"])
def test_load_refuses_a_split_document_not_covered(tmp_path, damage):
    path, data = _save_json(_split_plan(), tmp_path)
    spans = _spans_of(data, 7)
    last = max(spans, key=lambda x: data["steps"][x[0]]["replicas"][x[1]]["micro_batches"][x[2]]["spans"][x[3]][1])
    s, r, m, i = last
    mb = data["steps"][s]["replicas"][r]["micro_batches"][m]
    if damage == "shorten":
        mb["spans"][i][2] -= 100
    else:  # the last window gone (its micro-batch keeps its other documents)
        del mb["spans"][i]
        if not mb["docs"] and not mb["spans"]:
            pytest.skip("the window was alone in its micro-batch")
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError) as err:
        Plan.load(path)
    message = str(err.value)
    assert str(path) in message and "document 7 has 2500 tokens but its spans end at token" in message, message
    assert "step " in message and "replica " in message and "micro-batch " in message
    assert Plan.load(path, validate=False).num_docs == 40  # the opt-out still reads it


def test_truncated_plans_still_load_and_a_cut_elsewhere_is_refused(tmp_path):
    lengths = np.random.default_rng(3).integers(1, 400, 40)
    lengths[[4, 9]] = [3000, 5000]
    plan = balancer.plan(lengths, Topology(dp=2, micro_batches=3, max_tokens=1024), COST, seed=0, overflow="truncate")
    path, data = _save_json(plan, tmp_path)
    assert Plan.load(path).dropped_tokens == 3000 + 5000 - 2 * 1024
    for step in data["steps"]:
        for rep in step["replicas"]:
            for mb in rep["micro_batches"]:
                for span in mb.get("spans", []):
                    if span[0] == 9:
                        span[2] -= 10
    data["dropped_tokens"] += 10
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="document 9 has 5000 tokens but its spans end at token 1014"):
        Plan.load(path)
    data["dropped_tokens"] = 0  # a truncation the plan does not own up to
    for step in data["steps"]:
        for rep in step["replicas"]:
            for mb in rep["micro_batches"]:
                for span in mb.get("spans", []):
                    span[2] = 1024
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="document 4 has 3000 tokens but its spans end at token 1024.*missing"):
        Plan.load(path)


def test_load_refuses_nesting_that_disagrees_with_the_topology(tmp_path):
    path, data = _save_json(_split_plan(), tmp_path)  # dp=2, micro_batches=3
    reps = data["steps"][0]["replicas"]
    reps[0]["micro_batches"].append(reps[1]["micro_batches"].pop())  # 4 + 2: the same total, re-sliced before
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"steps\[0\].replicas\[0\].micro_batches has 4 entries, but the topology"):
        Plan.load(path, validate=False)
    path, data = _save_json(_split_plan(), tmp_path)
    data["steps"][0]["replicas"].append(data["steps"][1]["replicas"].pop())
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"steps\[0\].replicas has 3 entries, but the topology has dp = 2"):
        Plan.load(path)


def test_dynamic_plan_slots_per_step_must_match(tmp_path):
    lengths = np.random.default_rng(4).integers(1, 900, 80)
    topo = Topology(dp=2, cp=2, micro_batches=2, max_tokens=1024, cp_sizes=(1, 2, 4))
    path, data = _save_json(balancer.plan(lengths, topo, COST, seed=0), tmp_path)
    assert Plan.load(path).dynamic
    data["steps"][0]["slots"].append(data["steps"][1]["slots"].pop())
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"steps\[0\].slots has 3 entries, but the topology has micro_batches = 2"):
        Plan.load(path)


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda d: d.__setitem__("format_version", 6), '"format_version": 6 is newer than this balancer reads'),
        (lambda d: d.__setitem__("format_version", 2), '"window": not part of format_version 2 (added in 3)'),
        (lambda d: d.__setitem__("format", "balancer.pln"), '"format": not a balancer.plan file'),
        (lambda d: d.__setitem__("seeed", 1), '"seeed": unknown key (did you mean "seed"?)'),
        (lambda d: d["cost_model"].__setitem__("causal", "false"), '"cost_model.causal": expected true or false'),
        (lambda d: d["cost_model"].__setitem__("window", True), '"cost_model.window": expected an integer >= 1'),
        (lambda d: d["topology"].__setitem__("dp", True), '"topology.dp": expected an integer >= 1, got true'),
        (lambda d: d["topology"].__setitem__("dp", 2**64), '"topology.dp": expected an integer in [1, 2^63-1]'),
        (lambda d: d["steps"][0]["replicas"][0].__setitem__("micro_batch", []), "unknown key"),
        (lambda d: d["steps"][0]["replicas"][0]["micro_batches"][0].__setitem__("doc", [1]), ".doc: unknown key"),
    ],
)
def test_load_reads_the_header_strictly(tmp_path, edit, needle):
    path = _tamper_json(tmp_path, edit)
    with pytest.raises(ValueError) as err:
        Plan.load(path)
    assert str(path) in str(err.value) and needle in str(err.value), str(err.value)


def test_version_1_plans_still_load(tmp_path):
    """Plans as versions 2 and 1 wrote them (version 1: "format": "balancer.plan/1", no format_version, NaN
    plan_seconds) still load."""
    plan = _small_plan()
    path, data = _save_json(plan, tmp_path)
    assert data["format"] == "balancer.plan" and data["format_version"] == 3
    del data["window"]  # version 3's key
    path.write_text(json.dumps({**data, "format_version": 2}))
    assert np.array_equal(Plan.load(path).doc, plan.doc)  # version 2 still loads
    del data["format_version"]
    data["format"] = "balancer.plan/1"
    data["plan_seconds"] = None
    path.write_text(json.dumps(data).replace('"plan_seconds":null', '"plan_seconds":NaN'))
    back = Plan.load(path)
    assert np.array_equal(back.doc, plan.doc) and np.isnan(back.plan_seconds)
    data["format_version"] = 1
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="not used with the old format name"):
        Plan.load(path)


def _npz_bytes(tmp_path) -> bytes:
    path = tmp_path / "good.npz"
    _small_plan().save(path)
    return path.read_bytes()


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b[: len(b) // 2],  # truncated: BadZipFile
        lambda b: b[:20],  # EOFError
        lambda b: b"",
        lambda b: b"not a zip at all",
        lambda b: b[:200] + bytes(x ^ 0x5A for x in b[200:400]) + b[400:],  # zlib.error / CRC mismatch
    ],
)
def test_damaged_npz_is_one_error_naming_the_file(tmp_path, damage):
    path = tmp_path / "p.npz"
    path.write_bytes(damage(_npz_bytes(tmp_path)))
    with pytest.raises(ValueError) as err:
        Plan.load(path)
    assert str(err.value).startswith(f"{path}: ") and "\n" not in str(err.value), str(err.value)


def test_npz_with_unknown_or_missing_arrays(tmp_path):
    path = _tamper_npz(tmp_path, lambda a: {"extra": np.arange(3)})
    with pytest.raises(ValueError, match="unknown array 'extra'"):
        Plan.load(path)
    path = _tamper_npz(tmp_path, lambda a: {"doc": None})
    with pytest.raises(ValueError, match="no 'doc' array"):
        Plan.load(path)
    path = _tamper_npz(tmp_path, lambda a: {"header": np.frombuffer(b'{"format": "balancer.plan"}', np.uint8)})
    with pytest.raises(ValueError, match=r"p.npz: missing key \"format_version\""):
        Plan.load(path)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**16),
    overflow=st.sampled_from(["split", "truncate"]),
    dp=st.integers(1, 3),
    m=st.integers(1, 3),
    dynamic=st.booleans(),
    cut=st.integers(1, 50),
    data=st.data(),
)
def test_any_shortened_span_is_refused(seed, overflow, dp, m, dynamic, cut, data):
    """Planner output always validates; shortening any one placement's end (a span's or a whole document's) by
    `cut` tokens, with dropped_tokens kept or adjusted to match, is always refused."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 300, 12 * dp * m + 5)
    lengths[rng.integers(0, len(lengths), 3)] = rng.integers(600, 2000, 3)  # over the cap: split or truncated
    sizes = (1, 2) if dynamic else None
    topo = Topology(dp=dp, cp=2 if dynamic else 1, micro_batches=m, max_tokens=256, cp_sizes=sizes)
    plan = balancer.plan(lengths, topo, COST, seed=seed, overflow=overflow)
    plan.validate()
    i = data.draw(st.integers(0, len(plan.doc) - 1))
    assume(plan.end[i] - plan.start[i] > cut)
    end = plan.end.copy()
    end[i] -= cut
    groups = (plan.group_start, plan.group_size, plan.slot_ptr) if dynamic else None
    for dropped in (plan.dropped_tokens, plan.dropped_tokens + cut):
        broken = Plan(plan.lengths, topo, COST, plan.doc, plan.start, end, plan.mb_ptr, dropped_tokens=dropped,
                      groups=groups)  # fmt: skip
        with pytest.raises(
            ValueError, match=f"document {plan.doc[i]} |gap or overlap|dropped_tokens|other documents are cut"
        ):
            broken.validate()
