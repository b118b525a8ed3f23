"""BalancedStream in one process: sources (lists, `datasets` streaming files, a pretokenized folder), exact resume
(also through torchdata's StatefulDataLoader and PackedCollator), refused states and inputs, DataLoader workers,
`update_model`, `set_epoch`, and the stream-cutting rules (hypothesis)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from stream_cases import STRIDE, all_tokens, doc_rows, open_hf, tokens_of, write_shards

import balancer
from balancer.streaming import BalancedStream
from balancer.streaming.reading import quotas
from balancer.streaming.sources import StreamSpec, initial_streams, split_streams

TOPO = balancer.Topology(dp=1, micro_batches=2, max_tokens=512)
COST = balancer.CostModel(1.0, 50.0)


def _ids(batches):
    return [[np.asarray(r["input_ids"]).tolist() for r in mb] for mb in batches]


def test_list_source_exactly_once_and_resume_everywhere():
    rows = doc_rows(120, 0, long_every=17)
    full = list(BalancedStream(rows, TOPO, COST, window_docs=24, overflow="split"))
    assert tokens_of(full) == all_tokens(rows)
    for stop in (0, 1, 9, 10, len(full) - 1, len(full)):
        s = BalancedStream(rows, TOPO, COST, window_docs=24, overflow="split")
        it = iter(s)
        head = [next(it) for _ in range(stop)]
        state = json.loads(json.dumps(s.state_dict()))
        again = BalancedStream(rows, TOPO, COST, window_docs=24, overflow="split")
        again.load_state_dict(state)
        assert _ids(head + list(again)) == _ids(full), stop


def test_hf_streaming_shards_and_columns(tmp_path):
    rows = doc_rows(90, 1)
    paths = write_shards(tmp_path, rows, [30, 5, 55], "jsonl")
    ds = open_hf(paths)
    s = BalancedStream(ds, TOPO, COST, window_docs=20)
    out = list(s)
    assert tokens_of(out) == all_tokens(rows)
    assert s.source.num_parts == 3
    assert {r["tag"] for mb in out for r in mb} == {f"d{d}" for d in range(90)}


def test_stateful_dataloader_with_packed_collator(tmp_path):
    from torchdata.stateful_dataloader import StatefulDataLoader

    rows = doc_rows(100, 2)
    paths = write_shards(tmp_path, rows, [50, 50], "parquet")
    coll = balancer.PackedCollator()

    def loader():
        stream = BalancedStream(open_hf(paths, "parquet"), TOPO, COST, window_docs=20)
        return StatefulDataLoader(stream, batch_size=None, collate_fn=coll)

    full = [b["input_ids"].clone() for b in loader()]
    dl = loader()
    it = iter(dl)
    head = [next(it)["input_ids"].clone() for _ in range(13)]
    state = dl.state_dict()
    dl2 = loader()
    dl2.load_state_dict(state)
    rest = [b["input_ids"].clone() for b in dl2]
    assert len(head) + len(rest) == len(full)
    assert all(torch.equal(a, b) for a, b in zip(head + rest, full))


def test_pretokenized_folder_as_a_stream(tmp_path):
    from balancer.data.pretokenize import PretokenizeOptions, pretokenize
    from balancer.data.shards.dataset import ShardDataset

    texts = [f"word{i} " * (1 + i % 37) for i in range(150)]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "tok"
    pretokenize([str(src)], out, options=PretokenizeOptions(shard_tokens=4000), progress=False)
    ds = ShardDataset(out)
    s = BalancedStream(str(out), TOPO, COST, window_docs=30, overflow="split")
    assert s.source.num_parts > 1
    got = sorted((r["doc_id"], tuple(np.asarray(r["input_ids"]).tolist())) for mb in s for r in mb)
    want = sorted((int(ds.doc_ids[i]), tuple(ds.token_ids(i).tolist())) for i in range(len(ds)))
    assert got == want


def test_workers_refused_with_one_line():
    s = BalancedStream(doc_rows(40, 0), TOPO, COST, window_docs=8)
    with pytest.raises(RuntimeError, match="num_workers=0") as e:
        list(torch.utils.data.DataLoader(s, batch_size=None, num_workers=1))
    assert "BalancedStream runs in the training process" in str(e.value)


def _state_after(rows, n, **kw):
    s = BalancedStream(rows, TOPO, COST, window_docs=kw.pop("window_docs", 16), **kw)
    it = iter(s)
    for _ in range(n):
        next(it)
    return s.state_dict()


@pytest.mark.parametrize(
    "change, match",
    [
        ({"seed": 1}, "seed=0, this stream has seed=1"),
        ({"window_docs": 32}, "window_docs=16, this stream has window_docs=32"),
        ({"overflow": "split"}, "overflow='error', this stream has overflow='split'"),
    ],
)
def test_mismatched_states_refused(change, match):
    rows = doc_rows(60, 0)
    state = _state_after(rows, 5)
    kw = {"window_docs": 16, **change}
    s = BalancedStream(rows, TOPO, COST, **kw)
    with pytest.raises(ValueError, match=match):
        s.load_state_dict(state)


def test_bad_states_refused():
    rows = doc_rows(60, 0)
    state = _state_after(rows, 5)
    s = BalancedStream(rows, TOPO, COST, window_docs=16)
    for bad, match in [
        ("nope", "not a BalancedStream state"),
        ({**state, "format": "balancer.sampler"}, "not a BalancedStream state"),
        ({**state, "position": -1}, "position"),
        ({**state, "streams": [[0, 0, 0, 0, 0]]}, r"streams\[0\]"),
        ({**state, "taken": None}, "must be null exactly"),
        ({**state, "extra": 1}, "extra"),
    ]:
        with pytest.raises(ValueError, match=match):
            s.load_state_dict(bad)
    other = doc_rows(60, 5)  # another source with the same shape: the re-read window's lengths differ
    s2 = BalancedStream(other, TOPO, COST, window_docs=16)
    s2.load_state_dict(state)
    with pytest.raises(ValueError, match="the source changed"):
        next(iter(s2))


def test_bad_inputs():
    with pytest.raises(TypeError, match="an iterator"):
        BalancedStream(iter(doc_rows(10, 0)), TOPO, COST, window_docs=8)
    with pytest.raises(ValueError, match="window_docs"):
        BalancedStream(doc_rows(10, 0), balancer.Topology(dp=1, micro_batches=4), COST, window_docs=2)
    with pytest.raises(ValueError, match="torch.distributed"):
        BalancedStream(doc_rows(10, 0), balancer.Topology(dp=2), COST, window_docs=8)
    for rows, match in [
        (["some text"], "tokenize the stream first"),
        ([{"input_ids": []}], "empty document"),
        ([{"text": "x"}], "without 'input_ids'"),
    ]:
        with pytest.raises(RuntimeError, match=match):
            list(BalancedStream(rows * 10, TOPO, COST, window_docs=8))
    # 3 documents cannot fill 4 micro-batches: one short step of 3 (the same on every rank), not an error
    assert len(list(BalancedStream(doc_rows(3, 0), balancer.Topology(dp=1, micro_batches=4), COST, window_docs=4))) == 3


def test_update_model_from_a_window_on():
    rows = doc_rows(100, 0)
    s = BalancedStream(rows, TOPO, COST, window_docs=20)
    new = balancer.CostModel(1.0, 5000.0)
    if "rank_speeds" not in balancer.Topology.__dataclass_fields__:  # before the measured-balance work lands
        with pytest.raises(ValueError, match="has no rank_speeds"):
            s.update_model(new, rank_speeds=(1.0,), first_window=3)
    with pytest.raises(ValueError, match="first_window"):
        s.update_model(new, first_window=-1)
    s.update_model(new, first_window=2)
    it = iter(s)
    costs = {}
    for _ in it:
        costs[it.win.index] = it.win.segment.cost
    assert costs[0] == COST and costs[1] == COST and costs[2] == new and costs[max(costs)] == new
    with pytest.raises(ValueError, match="already planned"):
        s.update_model(new, first_window=1)
    state = s.state_dict()
    assert state["models"][0]["first_window"] == 2


def _costs_by_window(it) -> dict:
    costs = {}
    for _ in it:
        costs[it.win.index] = it.win.segment.cost
    return costs


def test_a_new_pass_plans_every_window_with_the_latest_model():
    s = BalancedStream(doc_rows(100, 0), TOPO, COST, window_docs=20)
    new = balancer.CostModel(1.0, 5000.0)
    s.update_model(new, first_window=3)
    it = iter(s)
    first = _costs_by_window(it)
    assert first[2] == COST and first[3] == new
    s.set_epoch(1)
    assert s.next_unplanned_window == 0 and s.model_for(0) == (TOPO, new)
    newer = balancer.CostModel(2.0, 50.0)
    s.update_model(newer, first_window=1)  # nothing of the new pass is planned yet
    it = iter(s)
    second = _costs_by_window(it)
    assert second[0] == new and all(c == newer for w, c in second.items() if w >= 1)
    assert [m["first_window"] for m in s.state_dict()["models"]] == [0, 1]


def test_step_loss_tokens_match_the_collator():
    rows = doc_rows(60, 6)
    for d, row in enumerate(rows):  # masked labels on some whole documents
        if d % 3 == 0:
            row["labels"] = [-100 if i % 2 else t for i, t in enumerate(row["input_ids"])]
    s = BalancedStream(rows, TOPO, COST, window_docs=12)
    coll = balancer.PackedCollator()
    per_step = {}
    for j, mb in enumerate(s):
        told = s.step_loss_tokens()
        per_step.setdefault(j // TOPO.micro_batches, [told, 0])[1] += coll(mb)["num_loss_tokens"]
    assert per_step and all(told == summed for told, summed in per_step.values())


def test_set_epoch_replays_the_source():
    rows = doc_rows(80, 4)
    s = BalancedStream(rows, TOPO, COST, window_docs=16)
    e0 = list(s)
    s.set_epoch(1)
    e1 = list(s)
    assert tokens_of(e0) == tokens_of(e1) == all_tokens(rows)
    assert s.state_dict()["epoch"] == 1


@settings(max_examples=60, deadline=None)
@given(
    parts=st.lists(st.integers(0, 40), min_size=1, max_size=5),
    world=st.integers(1, 9),
    new_world=st.integers(1, 9),
    frac=st.floats(0, 1),
)
def test_stream_cuts_cover_every_item_once(parts, world, new_world, frac):
    """Streams of a fresh pass, read to any positions, then re-cut for another world: together exactly the items."""

    def items(spec: StreamSpec, start: int):
        return [(spec.part, i) for i in range(spec.offset + spec.stride * start, parts[spec.part], spec.stride)]

    specs = initial_streams(len(parts), world)
    assert len(specs) >= world
    pos = [int(frac * len(items(s, 0))) for s in specs]
    consumed = [x for s, p in zip(specs, pos) for x in items(s, 0)[:p]]
    new_specs, new_pos = split_streams(specs, pos, new_world)
    assert len(new_specs) >= new_world
    rest = [x for s, p in zip(new_specs, new_pos) for x in items(s, p)]
    every = [(p, i) for p, n in enumerate(parts) for i in range(n)]
    assert sorted(consumed + rest) == every


@given(ended=st.lists(st.booleans(), min_size=1, max_size=8), window=st.integers(1, 100))
def test_quotas_split_the_window(ended, window):
    q = quotas(ended, window)
    assert q.sum() == (window if not all(ended) else 0)
    assert all(q[v] == 0 for v, e in enumerate(ended) if e)
    assert STRIDE > 0


def _bench():
    import importlib.util
    import sys
    from pathlib import Path

    folder = Path(__file__).resolve().parents[2] / "benchmarks"
    sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location("bench_streaming", folder / "streaming.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_uneven_streams_end_rounds_and_the_benchmark_replays_the_rule(tmp_path):
    """Shards of very different sizes with a large reserve (dp*M = 8): the extra rounds near the end keep every
    window able to fill a step; the benchmark's replay of the rule gives the same windows as the stream."""
    bench = _bench()
    rows = doc_rows(200, 9)
    order = np.random.default_rng(0).permutation(200)
    sizes = [len(c) for c in np.array_split(order, bench.SOURCE_SHARDS)]
    shuffled = [rows[i] for i in order]
    paths = write_shards(tmp_path, shuffled, sizes, "jsonl")
    topo = balancer.Topology(dp=1, micro_batches=8, max_tokens=2048)
    s = BalancedStream(open_hf(paths), topo, COST, window_docs=24)
    it = iter(s)
    windows, out = {}, []
    for mb in it:
        out.append(mb)
        windows.setdefault(it.win.index, set()).update(r["doc"] for r in mb)
    assert tokens_of(out) == all_tokens(rows)
    replay = bench.stream_windows(order, 1, 24, topo.bins_per_step)
    assert [windows[i] for i in sorted(windows)] == [set(w.tolist()) for w in replay]
    assert min(len(w) for w in replay) >= topo.bins_per_step
