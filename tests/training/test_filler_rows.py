"""Loss-masked filler rows, the explicit opt-in for fixed-length rows that no short last step splits equally over the
replicas: the fewest copies of real rows are added, recorded in the plan and its files, yielded as `Filler`
indices, and turned by `PackedCollator` into tokens of no document whose labels are all ignored; every real row is
still placed exactly once."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import balancer
from balancer.planning.steps import ShortStepError
from balancer.training import Filler, SpanDataset

COST = balancer.CostModel(attn_coef=1e-3, linear_coef=1.0)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 80), st.integers(0, 3))
def test_fillers_make_any_count_plan_and_every_real_row_stays_once(dp, m, n, seed):
    topo = balancer.Topology(dp=dp, micro_batches=m, max_tokens=8)
    lengths = np.full(n, 8)
    try:
        balancer.plan(lengths, topo, COST, seed=seed)
        needed = False
    except ShortStepError as e:
        needed = True
        assert "filler_rows=True" in str(e) and e.missing >= 1
    p = balancer.plan(lengths, topo, COST, seed=seed, filler_rows=True)
    p.validate()
    assert (p.filler_rows > 0) == needed
    real = p.doc if p.filler is None else p.doc[~p.filler]
    assert sorted(real.tolist()) == list(range(n))  # every real row exactly once
    counts = np.diff(p.mb_ptr)
    assert len(counts) == (p.num_steps - 1) * topo.bins_per_step + dp * p.last_micro_batches and counts.min() >= 1
    m_ = p.metrics()
    assert m_["padding_tokens"] == 8 * p.filler_rows and m_["dropped_tokens"] == 0
    if needed:  # the fillers sit in the last step only, and are fewer than dp
        assert p.filler_rows < dp and np.all(p.step_of_entry()[p.filler] == p.num_steps - 1)


def test_filler_plans_round_trip_and_are_checked(tmp_path):
    topo = balancer.Topology(dp=4, micro_batches=2, max_tokens=16)
    p = balancer.plan(np.full(1001, 16), topo, COST, filler_rows=True)
    assert (p.num_steps, p.last_micro_batches, p.filler_rows) == (126, 1, 3)
    for name in ("p.json", "p.npz"):
        p.save(tmp_path / name)
        back = balancer.Plan.load(tmp_path / name)
        assert back.filler_rows == 3 and np.array_equal(back.filler, p.filler) and np.array_equal(back.doc, p.doc)
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["filler_rows"] == 3 and data["format_version"] == 5
    fillers = [mb.get("fillers", []) for r in data["steps"][-1]["replicas"] for mb in r["micro_batches"]]
    assert sum(len(f) for f in fillers) == 3
    data["filler_rows"] = 2  # the count must match the rows
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="filler_rows"):
        balancer.Plan.load(tmp_path / "bad.json")


def test_sampler_yields_fillers_the_collator_masks():
    """21 rows on dp 4 x 2: 5 left for the last step cannot split over 4 replicas; 3 filler rows fill it. Every
    real row is yielded once over the ranks, fillers carry no loss tokens and count as no document."""
    topo = balancer.Topology(dp=4, micro_batches=2, max_tokens=8)
    rows = [list(range(i, i + 8)) for i in range(21)]
    ds = SpanDataset([{"input_ids": r} for r in rows])
    collate = balancer.PackedCollator(cp_rank=0, cp_size=1)
    with pytest.raises(ValueError, match="filler_rows=True"):
        list(balancer.BalancedBatchSampler(np.full(21, 8), topo, COST, dp_rank=0))
    seen, filler_tokens, loss_tokens = [], 0, 0
    for r in range(4):
        sampler = balancer.BalancedBatchSampler(np.full(21, 8), topo, COST, dp_rank=r, filler_rows=True)
        out = list(sampler)
        assert len(out) == len(sampler) == 2 * sampler.num_steps
        for mb in out:
            batch = collate([ds[i] for i in mb])
            n_fill = sum(isinstance(i, Filler) for i in mb)
            assert batch["num_filler_tokens"] == 8 * n_fill and batch["num_tokens"] == 8 * (len(mb) - n_fill)
            assert batch["num_sequences"] == len(mb) - n_fill
            assert torch.all(batch["labels"][batch["seq_ids"] < 0] == -100)
            filler_tokens += batch["num_filler_tokens"]
            loss_tokens += batch["num_loss_tokens"]
        seen += [i for mb in out for i in mb if not isinstance(i, Filler)]
    assert sorted(seen) == list(range(21)) and filler_tokens == 3 * 8
    assert loss_tokens == 21 * 7 == sum(sampler.step_loss_tokens(s) for s in range(sampler.num_steps))
    with pytest.raises(TypeError, match="SpanDataset"):
        [{"input_ids": r} for r in rows][Filler(3)]


@pytest.mark.slow  # two `balancer plan` processes
def test_cli_filler_rows(tmp_path):
    src = tmp_path / "rows.npy"
    np.save(src, np.full(32 * 40 + 5, 4096, dtype=np.int64))
    out = tmp_path / "plan.json"
    run = [sys.executable, "-m", "balancer", "plan", str(src), "-o", str(out)]
    r = subprocess.run(run, capture_output=True, text=True)
    assert r.returncode == 2 and "pass --filler-rows to add 3 loss-masked filler row(s)" in r.stderr, r.stderr
    assert "filler_rows=" not in r.stderr
    r = subprocess.run([*run, "--filler-rows"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "3 loss-masked filler row(s) added" in r.stdout and "runs 1 of micro_batches = 4" in r.stdout, r.stdout
    plan = balancer.Plan.load(out)
    assert plan.filler_rows == 3 and sorted(plan.doc[~plan.filler].tolist()) == list(range(32 * 40 + 5))


@pytest.mark.parametrize("window_docs", [21, 10])
def test_stream_windows_end_in_a_short_step(window_docs):
    """BalancedStream plans each window like the sampler: 21 rows on dp 1 x 2 micro-batches leave a short last step
    (one micro-batch) per window whose row count is odd; every row comes once and len-free iteration ends there."""
    topo = balancer.Topology(dp=1, micro_batches=2, max_tokens=8)
    rows = [list(range(i, i + 8)) for i in range(21)]
    out = list(balancer.BalancedStream(rows, topo, COST, window_docs=window_docs, dp_rank=0))
    assert len(out) == 21  # one row per micro-batch
    assert sorted(int(r["input_ids"][0]) for mb in out for r in mb) == list(range(21))


def test_fillers_copy_whole_rows_when_rows_are_cut():
    """With rows longer than a micro-batch (overflow truncate or split) a filler still copies a whole row: it is read
    as its whole row, so a copy of a cut row held more tokens than its place in the plan (rows of 9-17 tokens at
    max_tokens 8: fillers of 14 tokens in 8-token places, a plan its own validate refused). Without a whole row
    to copy, the plan is refused naming filler_rows."""
    topo = balancer.Topology(dp=4, micro_batches=2, max_tokens=8)
    lengths = np.random.default_rng(0).integers(9, 18, 21)
    with pytest.raises(ValueError, match="filler_rows=True: the last step needs 3 filler rows"):
        balancer.plan(lengths, topo, COST, filler_rows=True, overflow="truncate")
    with pytest.raises(ValueError, match="every row is cut to 8-token units"):
        balancer.plan(np.full(21, 16), topo, COST, filler_rows=True, overflow="split")  # 42 halves: 2 fillers
    lengths[[3, 7]] = 8
    split = np.array([16] * 20 + [8] * 3)  # 43 units of 8: one filler, a copy of a row of 8
    for rows, overflow, whole in ((lengths, "truncate", {3, 7}), (split, "split", {20, 21, 22})):
        p = balancer.plan(rows, topo, COST, filler_rows=True, overflow=overflow)
        assert p.filler_rows > 0 and set(p.doc[p.filler].tolist()) <= whole
        assert np.all(p.end[p.filler] - p.start[p.filler] == rows[p.doc[p.filler]])
        p.validate()
