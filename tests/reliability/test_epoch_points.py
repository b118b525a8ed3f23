"""`len()` and `set_epoch` at every point of an epoch, on two gloo processes, for `BalancedBatchSampler` (windowed
epochs planned ahead) and `BalancedStream` (no `len()`: an IterableDataset of unknown length): before iterating,
mid-pass, after the end and twice in a row. Every pass covers every document exactly once over the ranks, both
ranks get the same number of micro-batches, and the sampler's `len()` is what each rank receives. Old: an iterator
of the sampler read on after `set_epoch(other)` mid-pass went on with the new epoch's plan (the old pass's rest
lost, the loop one pass longer, unnoticed), and `set_epoch(1.5)`, `set_epoch(True)`, `set_epoch(-1)`, `set_epoch("2")`
were taken."""

from __future__ import annotations

import math
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
from support.dist import run_world

import balancer
from balancer.streaming import BalancedStream
from balancer.training.sampler import BalancedBatchSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "streaming"))
from stream_cases import doc_rows  # noqa: E402

N = 160
TOPO = balancer.Topology(dp=2, micro_batches=2, max_tokens=512)
COST = balancer.CostModel(1.0, 50.0)
LENGTHS = np.random.default_rng(5).integers(10, 200, N)  # up to 400: see the last test


def _drain(it, limit: int = 10**6) -> list:
    out = []
    for mb in it:
        out.append(mb)
        if len(out) == limit:
            break
    return out


def _sampler_rank(rank: int, world: int, out: str) -> None:
    """Each scenario of the sampler on this rank: (label, epoch, micro-batches of one pass, len() seen at each
    point); written to `out/sampler{rank}.pkl`."""
    s = BalancedBatchSampler(LENGTHS, TOPO, COST, window_docs=40, seed=3)
    rec: dict = {"len_before": [len(s), len(s)]}  # twice in a row, before any iter()
    it = iter(s)
    head = _drain(it, 7)
    rec["len_mid"] = len(s)
    rest = _drain(it)
    rec["len_end"] = [len(s), len(s)]
    rec["pass0"] = head + rest
    rec["again_after_end"] = _drain(it)  # an exhausted iterator stays exhausted
    s.set_epoch(1)
    s.set_epoch(1)  # twice in a row: one new pass
    rec["len_epoch1"] = len(s)
    it = iter(s)
    head = _drain(it, 5)
    s.set_epoch(2)  # mid-pass
    try:
        next(it)
        rec["stale"] = None
    except RuntimeError as e:
        rec["stale"] = str(e)
    rec["len_epoch2"] = len(s)
    rec["pass2"] = _drain(iter(s))
    rec["pass1_head"] = head
    s.set_epoch(1)
    rec["pass1"] = _drain(iter(s))
    rec["pass1_len"] = len(s)
    s.set_epoch(0)  # back to the first epoch after its end: the same pass again
    rec["pass0_again"] = _drain(iter(s))
    rec["bad_epochs"] = []
    for value in (1.5, True, -1, "2", math.nan, math.inf):
        try:
            s.set_epoch(value)
            rec["bad_epochs"].append((repr(value), "taken"))
        except ValueError as e:
            rec["bad_epochs"].append((repr(value), str(e)))
    Path(out, f"sampler{rank}.pkl").write_bytes(pickle.dumps(rec))


def _docs(batches) -> list:
    return [int(i) for mb in batches for i in mb]


@pytest.mark.slow  # two spawned gloo processes
def test_sampler_len_and_set_epoch_at_every_point(tmp_path):
    run_world(2, _sampler_rank, str(tmp_path))
    recs = [pickle.loads((tmp_path / f"sampler{r}.pkl").read_bytes()) for r in range(2)]
    for rec in recs:
        n = len(rec["pass0"])
        assert rec["len_before"] == [n, n] and rec["len_mid"] == n and rec["len_end"] == [n, n]
        assert rec["again_after_end"] == []
        assert rec["len_epoch1"] == len(rec["pass1"]) == rec["pass1_len"]
        assert rec["len_epoch2"] == len(rec["pass2"])
        assert rec["pass1"][: len(rec["pass1_head"])] == rec["pass1_head"]  # the epoch-1 pass replays whole
        assert rec["stale"] is not None and "set_epoch(2) was called while this pass (epoch 1)" in rec["stale"]
        assert rec["pass0_again"] == rec["pass0"]
        for value, outcome in rec["bad_epochs"]:
            assert outcome.startswith("epoch must be a non-negative integer"), (value, outcome)
    for key in ("pass0", "pass1", "pass2"):
        assert len(recs[0][key]) == len(recs[1][key]), key  # equal micro-batch counts on both ranks
        every = sorted(_docs(recs[0][key]) + _docs(recs[1][key]))
        assert every == list(range(N)), key  # every document exactly once per pass
    assert recs[0]["pass1"] != recs[0]["pass0"]  # another epoch, another plan


ROWS = doc_rows(N, 7)


def _stream_rank(rank: int, world: int, out: str) -> None:
    s = BalancedStream(ROWS, TOPO, COST, window_docs=24, seed=3)
    rec: dict = {}
    try:
        len(s)
        rec["len"] = "taken"
    except TypeError as e:
        rec["len"] = str(e)
    s.set_epoch(0)
    s.set_epoch(0)  # before iterating, twice
    it = iter(s)
    rec["pass0"] = [[r["doc"] for r in mb] for mb in _drain(it)]
    rec["after_end"] = _drain(it)
    s.set_epoch(1)
    s.set_epoch(1)
    it = iter(s)
    head = [[r["doc"] for r in mb] for mb in _drain(it, 9)]  # past half of the first window: the next job in flight
    s.set_epoch(2)
    try:
        next(it)
        rec["stale"] = None
    except RuntimeError as e:
        rec["stale"] = str(e)
    rec["pass2"] = [[r["doc"] for r in mb] for mb in _drain(iter(s))]
    s.set_epoch(1)
    rec["pass1"] = [[r["doc"] for r in mb] for mb in _drain(iter(s))]
    rec["pass1_head"] = head
    s.set_epoch(0)
    rec["pass0_again"] = [[r["doc"] for r in mb] for mb in _drain(iter(s))]
    s.close()
    Path(out, f"stream{rank}.pkl").write_bytes(pickle.dumps(rec))


@pytest.mark.slow  # two spawned gloo processes
def test_stream_set_epoch_at_every_point(tmp_path):
    run_world(2, _stream_rank, str(tmp_path))
    recs = [pickle.loads((tmp_path / f"stream{r}.pkl").read_bytes()) for r in range(2)]
    for rec in recs:
        assert "has no len()" in rec["len"]  # an IterableDataset of unknown length: no len() to trust
        assert rec["after_end"] == []
        assert rec["stale"] is not None and "set_epoch(2) was called while this pass (epoch 1)" in rec["stale"]
        assert rec["pass1"][: len(rec["pass1_head"])] == rec["pass1_head"]
        assert rec["pass0_again"] == rec["pass0"]
    for key in ("pass0", "pass1", "pass2"):
        assert len(recs[0][key]) == len(recs[1][key]), key
        every = sorted(d for rec in recs for mb in rec[key] for d in mb)
        assert every == list(range(N)), key


def test_windowed_epochs_plan_with_documents_near_the_micro_batch_size():
    # found by this file: documents of up to 400 tokens against micro-batches of 512 made some windows of 40
    # documents unplannable in the step count fixed for them ahead (window_step_count) for some (seed, epoch): the
    # sampler's len() promised the micro-batches, then the planner raised "could not place k documents in the fixed
    # 5 steps" mid-epoch (epoch 1 / seed 3, epoch 2 / seed 0: a 250-token document fits none of the 20 micro-batches
    # holding one of 274-392 tokens each). Now the count is proven by best-fit-decreasing packing where the units
    # may fragment (balancer.planning.window.packed_cut; tests/reliability/test_window_counts_hold.py)
    lengths = np.random.default_rng(5).integers(10, 400, N)
    for seed, epoch in ((3, 1), (0, 2)):
        docs = []
        for rank in range(TOPO.dp):
            s = BalancedBatchSampler(lengths, TOPO, COST, window_docs=40, seed=seed, dp_rank=rank)
            s.set_epoch(epoch)
            got = list(s)
            assert len(got) == len(s)
            docs += _docs(got)
        assert sorted(docs) == list(range(N))
