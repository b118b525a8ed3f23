"""Windowed planning: the epoch shuffle is a bijection, windows partition it, `plan_window` with one window is the
whole-epoch plan, window plans place every document exactly once per epoch, every rank's sampler sees its view of
the same window plans, and bad window sizes are refused naming the argument."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.coverage import covered_tokens

import balancer
from balancer.planning.shuffle import EpochShuffle, num_windows, window_ids, window_range

COST = balancer.CostModel(attn_coef=1.0, linear_coef=50.0)
TOPO = balancer.Topology(dp=4, cp=2, micro_batches=2, max_tokens=256, tokens_per_step=2800)


def _lengths(n=600, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(1, 120, n)
    x[rng.choice(n, 12, replace=False)] = rng.integers(200, 512, 12)
    return x


LENGTHS = _lengths()


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5000), st.integers(0, 2**32), st.integers(0, 50))
def test_epoch_shuffle_is_a_bijection(n, seed, epoch):
    ids = EpochShuffle(n, seed, epoch)(np.arange(n))
    assert np.array_equal(np.sort(ids), np.arange(n))


def test_epoch_shuffle_depends_on_seed_and_epoch_and_mixes():
    n = 100_000
    a, b, c = (EpochShuffle(n, s, e)(np.arange(n)) for s, e in [(0, 0), (1, 0), (0, 1)])
    assert not np.array_equal(a, b) and not np.array_equal(a, c)
    assert abs(np.corrcoef(np.arange(n), a)[0, 1]) < 0.02  # no trace of the original order
    first = a[: n // 10]  # a window draws from the whole corpus
    assert np.histogram(first, bins=10, range=(0, n))[0].min() > 0.8 * n // 100


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 3000), st.integers(1, 3000))
def test_windows_partition_the_shuffle(n, w):
    k = num_windows(n, w)
    ranges = [window_range(n, w, i) for i in range(k)]
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert all(stop - first == w for first, stop in ranges[:-1])  # every window but the last holds window_docs
    last = ranges[-1][1] - ranges[-1][0]
    assert k == 1 or w // 4 <= last < w + w // 4 + 1  # a small rest joins the window before
    ids = np.concatenate([window_ids(n, 3, 1, i, w) for i in range(k)])
    assert np.array_equal(np.sort(ids), np.arange(n))


def test_one_window_is_the_whole_epoch_plan():
    for epoch in (0, 3):
        whole = balancer.plan(LENGTHS, TOPO, COST, seed=5 + epoch)
        for w in (len(LENGTHS), 10 * len(LENGTHS)):
            p = balancer.plan_window(LENGTHS, TOPO, COST, seed=5, epoch=epoch, index=0, window_docs=w)
            for a in ("doc", "start", "end", "mb_ptr"):
                assert np.array_equal(getattr(p, a), getattr(whole, a))
        s = balancer.BalancedBatchSampler(LENGTHS, TOPO, COST, dp_rank=1, seed=5, window_docs=len(LENGTHS))
        s.set_epoch(epoch)
        want = [mb for step in whole.rank_view(1) for mb in step]
        assert list(s) == want


@pytest.mark.slow  # hypothesis: ~4 s
@settings(max_examples=25, deadline=None)
@given(
    st.integers(0, 10_000),
    st.sampled_from([(1, 1, 2), (2, 2, 2), (4, 1, 3), (3, 2, 1)]),
    st.integers(20, 400),
    st.sampled_from(["error", "split"]),
)
def test_window_plans_place_every_token_once(seed, shape, window_docs, overflow):
    dp, cp, m = shape
    lengths = _lengths(500, seed % 97)
    if overflow == "split":
        lengths = np.concatenate([lengths, [900, 1300]])
    topo = balancer.Topology(dp=dp, cp=cp, micro_batches=m, max_tokens=512 // cp, tokens_per_step=dp * cp * m * 200)
    window_docs = max(window_docs, topo.bins_per_step * 4)
    k = num_windows(len(lengths), window_docs)
    got = Counter()
    for i in range(k):
        p = balancer.plan_window(
            lengths, topo, COST, seed=seed, epoch=2, index=i, window_docs=window_docs, overflow=overflow
        )
        assert p.window.index == i and p.window.num_windows == k
        assert set(p.doc.tolist()) == set(p.window_ids.tolist())  # a window's plan holds its documents only
        assert np.all(np.diff(p.mb_ptr) > 0) and np.all(p.micro_batch_tokens() <= topo.micro_batch_tokens)
        for d, a, b in zip(p.doc, p.start, p.end):
            got.update((int(d), t) for t in range(a, b))
    assert set(got.values()) == {1} and len(got) == int(lengths.sum())


@pytest.mark.slow  # ~9 s
@settings(max_examples=15, deadline=None)
@given(st.integers(0, 1000), st.integers(40, 300), st.sampled_from([(4, 2, 2), (2, 1, 3)]))
def test_every_rank_sees_its_view_of_the_same_window_plans(seed, window_docs, shape):
    dp, cp, m = shape
    topo = balancer.Topology(dp=dp, cp=cp, micro_batches=m, max_tokens=512 // cp, tokens_per_step=dp * cp * m * 150)
    samplers = [
        balancer.BalancedBatchSampler(LENGTHS, topo, COST, dp_rank=r, seed=seed, window_docs=window_docs)
        for r in range(dp)
    ]
    for s in samplers:
        s.set_epoch(1)
    views = [list(s) for s in samplers]
    k = num_windows(len(LENGTHS), window_docs)
    assert samplers[0].num_windows == k > 1
    plans = [
        balancer.plan_window(LENGTHS, topo, COST, seed=seed, epoch=1, index=i, window_docs=window_docs)
        for i in range(k)
    ]
    for r, view in enumerate(views):
        assert view == [mb for p in plans for step in p.rank_view(r) for mb in step]
        assert len(view) == samplers[r].num_steps * m == sum(p.num_steps for p in plans) * m
        assert len(view) <= len(samplers[r]) == len(samplers[0])  # several windows: len is an upper bound
    flat = sorted(int(i) for v in views for mb in v for i in mb)
    assert flat == list(range(len(LENGTHS)))  # every document exactly once per epoch
    again = balancer.BalancedBatchSampler(LENGTHS, topo, COST, dp_rank=0, seed=seed, window_docs=window_docs)
    again.set_epoch(2)
    assert list(again) != views[0]  # another epoch, another shuffle


def test_step_information_follows_the_windows():
    s = balancer.BalancedBatchSampler(LENGTHS, TOPO, COST, dp_rank=0, seed=1, window_docs=150)
    assert s.num_windows == 4
    tokens = sum(s.step_tokens(k) for k in range(s.num_steps))
    assert tokens == int(LENGTHS.sum())
    assert s.epoch_num_steps(0) == s.num_steps
    with pytest.raises(IndexError):
        s.step_tokens(s.num_steps)
    p = s.plan  # the window this rank is in (window 0 before iterating), global ids
    want = balancer.plan_window(LENGTHS, TOPO, COST, seed=1, epoch=0, index=0, window_docs=150)
    assert np.array_equal(p.doc, want.doc) and np.array_equal(p.mb_ptr, want.mb_ptr)
    for _ in s:  # the whole epoch: the rank ends in the last window, whose plan `plan` then gives
        pass
    last = balancer.plan_window(LENGTHS, TOPO, COST, seed=1, epoch=0, index=3, window_docs=150)
    assert np.array_equal(s.plan.doc, last.doc) and np.array_equal(s.plan.mb_ptr, last.mb_ptr)


@pytest.mark.parametrize(
    "value,error,match",
    [
        (0, ValueError, "window_docs"),
        (-5, ValueError, "window_docs"),
        (7, ValueError, "window_docs = 7 is below dp\\*micro_batches = 8"),
        (True, TypeError, "window_docs"),
        (2.5, TypeError, "window_docs"),
        ("100", TypeError, "window_docs"),
    ],
)
def test_bad_window_docs_named(value, error, match):
    with pytest.raises(error, match=match):
        balancer.BalancedBatchSampler(LENGTHS, TOPO, COST, dp_rank=0, window_docs=value)
    with pytest.raises(error, match=match):
        balancer.plan_window(LENGTHS, TOPO, COST, seed=0, epoch=0, index=0, window_docs=value)


def test_plan_window_bad_arguments_named():
    kw = dict(seed=0, epoch=0, index=0, window_docs=100)
    for name, value in [("seed", -1), ("epoch", True), ("index", 1.0)]:
        with pytest.raises((ValueError, TypeError), match=name):
            balancer.plan_window(LENGTHS, TOPO, COST, **{**kw, name: value})
    with pytest.raises(ValueError, match="index 6 out of range"):
        balancer.plan_window(LENGTHS, TOPO, COST, **{**kw, "index": 6})


def test_cli_writes_one_window(tmp_path):
    import subprocess
    import sys

    src = tmp_path / "lengths.npy"
    np.save(src, LENGTHS)
    out = tmp_path / "w1.json"
    base = [sys.executable, "-m", "balancer", "plan", str(src), "--dp", "4", "--cp", "2", "--micro-batches", "2"]
    run = subprocess.run([*base, "--max-tokens", "256", "--tokens-per-step", "2800", "--window-docs", "150",
                          "--window-index", "1", "--epoch", "2", "--seed", "3", "-o", str(out), "--no-baseline"],
                         capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "window 1 of 4 (epoch 2, seed 3)" in run.stderr
    got = balancer.Plan.load(out)  # validated: exactly its window's documents, each covered whole
    assert got.window == balancer.plan_window(LENGTHS, TOPO, COST, seed=3, epoch=2, index=1, window_docs=150).window
    cli_cost = balancer.CostModel(attn_coef=2 / 53000, linear_coef=1.0)  # the CLI default
    want = balancer.plan_window(LENGTHS, TOPO, cli_cost, seed=3, epoch=2, index=1, window_docs=150)
    assert np.array_equal(got.doc, want.doc) and np.array_equal(got.mb_ptr, want.mb_ptr)
    for extra, message in [
        (["--window-docs", "150"], "--window-docs and --window-index go together"),
        (["--window-docs", "150", "--window-index", "9"], "--window-index 9: 600 documents in windows of"),
        (["--window-docs", "3", "--window-index", "0"], "--window-docs = 3 is below dp\\*micro_batches"),
    ]:
        bad = subprocess.run([*base, "--max-tokens", "256", *extra, "-o", str(out)], capture_output=True, text=True)
        assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
        assert __import__("re").search(message, bad.stderr), bad.stderr


def test_dynamic_cp_windows_cover_every_token_once():
    topo = balancer.Topology(dp=2, cp=2, micro_batches=2, max_tokens=256, tokens_per_step=1800, cp_sizes=(1, 2, 4))
    lengths = np.concatenate([LENGTHS, [700, 900]])  # two documents only a group of 4 holds
    samplers = [balancer.BalancedBatchSampler(lengths, topo, COST, rank=r, window_docs=120) for r in range(4)]
    assert samplers[0].num_windows == 5
    views = [list(s) for s in samplers]
    assert len({len(v) for v in views}) == 1
    seen = Counter()
    for r, view in enumerate(views):
        for mb in view:
            group = mb[0].group
            assert all(i.group == group for i in mb) and group.start <= r < group.start + group.size
            if group.rank == 0:  # a micro-batch is counted once, by its group's first rank
                seen += covered_tokens(mb, lengths)
    assert set(seen.values()) == {1} and len(seen) == int(lengths.sum())
    with pytest.raises(ValueError, match=f"document {len(lengths) - 1} has 900 tokens"):
        big = balancer.Topology(dp=2, cp=2, micro_batches=2, max_tokens=200, cp_sizes=(1, 2, 4))
        balancer.BalancedBatchSampler(lengths, big, COST, rank=0)


def test_window_plan_files_validate_their_window(tmp_path):
    """A saved window plan records its window and loads validated; a plan file that drops one of the window's
    documents, places one outside it, or names a window the epoch does not have is refused naming what is wrong."""
    import json

    want = balancer.plan_window(LENGTHS, TOPO, COST, seed=3, epoch=2, index=1, window_docs=150)
    want.validate()
    for suffix in (".json", ".npz"):
        path = tmp_path / f"w{suffix}"
        want.save(path)
        got = balancer.Plan.load(path)
        assert got.window == want.window and np.array_equal(got.window_ids, want.window_ids)
        assert np.array_equal(got.doc, want.doc)
    data = json.loads((tmp_path / "w.json").read_text())
    outside = int(np.setdiff1d(np.arange(len(LENGTHS)), want.window_ids)[0])
    # a micro-batch of two or more documents, so that one can go without leaving it empty
    s_, r_, m_ = next(
        (s_, r_, m_)
        for s_, step in enumerate(data["steps"])
        for r_, rep in enumerate(step["replicas"])
        for m_, mb in enumerate(rep["micro_batches"])
        if len(mb["docs"]) > 1
    )

    def docs(d):
        return d["steps"][s_]["replicas"][r_]["micro_batches"][m_]["docs"]

    cases = {
        "documents are not in the plan": lambda d: docs(d).pop(),
        "is not in the plan's window": lambda d: docs(d).append(outside),
        "make window 1 of 4": lambda d: d["window"].update(stop=d["window"]["stop"] + 1),
    }
    for message, tamper in cases.items():
        bad = json.loads(json.dumps(data))
        tamper(bad)
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=message):
            balancer.Plan.load(tmp_path / "bad.json")
