"""Windowed sampling without whole copies: a pretokenized folder's lengths are read as one memory-mapped array
(`ShardedArray`) that plans exactly like the lengths in memory and never materialises the folder's length; and
`len(sampler)` is cheap (no window planned), the same on every rank, and exactly what the sampler yields."""

from __future__ import annotations

import pickle
import tracemalloc

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from support.data_files import write_jsonl  # noqa: E402

import balancer  # noqa: E402
from balancer.data.pretokenize.options import PretokenizeOptions  # noqa: E402
from balancer.data.pretokenize.pipeline import pretokenize  # noqa: E402
from balancer.data.shards.dataset import ShardDataset  # noqa: E402
from balancer.data.shards.lengths import read_lengths  # noqa: E402
from balancer.data.shards.sharded import ShardedArray  # noqa: E402
from balancer.planning.window import plan_steps_bound  # noqa: E402
from balancer.training import lengths as training_lengths  # noqa: E402
from balancer.training import segments  # noqa: E402

COST = balancer.CostModel(attn_coef=1.0, linear_coef=50.0)
N_DOCS = 200_000


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A real pretokenized folder (byte tokenizer) of N_DOCS documents of 1..39 tokens in 7 shards."""
    tmp = tmp_path_factory.mktemp("folder")
    sizes = np.random.default_rng(3).integers(1, 40, N_DOCS)
    write_jsonl(tmp / "in.jsonl", ["x" * int(k) for k in sizes])
    opts = PretokenizeOptions(shard_tokens=int(sizes.sum()) // 7 + 1)
    pretokenize([str(tmp / "in.jsonl")], tmp / "out", tokenizer="byte", options=opts, progress=False)
    assert len(list((tmp / "out").glob("*.lengths.npy"))) == 7
    return tmp / "out", sizes


def test_sharded_array_reads_like_the_concatenated_index(folder):
    path, sizes = folder
    ds = ShardDataset(path)
    view, whole = ds.lengths, read_lengths(path)
    assert isinstance(view, ShardedArray) and isinstance(whole, np.ndarray) and np.array_equal(whole, sizes)
    rng = np.random.default_rng(0)
    idx = rng.integers(-N_DOCS, N_DOCS, 5000)
    assert np.array_equal(view[idx], whole[idx]) and np.array_equal(
        view[idx[:12].reshape(3, 4)], whole[idx[:12]].reshape(3, 4)
    )
    for key in (slice(None), slice(28_000, 90_001), slice(-7, None), slice(5, 60_000, 7), slice(9, 3)):
        assert np.array_equal(view[key], whole[key]), key
    assert view[-1] == whole[-1] and view[123_457] == whole[123_457]
    assert (view.sum(), view.min(), view.max(), len(view)) == (whole.sum(), whole.min(), whole.max(), N_DOCS)
    assert np.array_equal(np.asarray(view), whole) and np.array_equal(view + 1, whole + 1)
    mask = whole > 20
    assert np.array_equal(view[mask], whole[mask])
    with pytest.raises(IndexError, match="out of bounds"):
        view[np.array([0, N_DOCS])]
    clone = pickle.loads(pickle.dumps(ds))  # a DataLoader worker maps the files again: no values pickled
    assert len(pickle.dumps(ds.lengths)) < 4096 and np.array_equal(np.asarray(clone.lengths), whole)
    assert np.array_equal(np.asarray(clone.doc_ids), np.arange(N_DOCS))


def test_folder_lengths_plan_like_lengths_in_memory(folder):
    path, sizes = folder
    topo = balancer.Topology(dp=4, cp=1, micro_batches=2, max_tokens=256, tokens_per_step=4 * 2 * 200)
    kw = dict(dp_rank=3, seed=5, window_docs=15_000)
    for source in (str(path), ShardDataset(path)):
        in_memory = balancer.BalancedBatchSampler(read_lengths(path), topo, COST, **kw)
        mapped = balancer.BalancedBatchSampler(source, topo, COST, **kw)
        assert isinstance(mapped.lengths, ShardedArray)
        mapped.set_epoch(1), in_memory.set_epoch(1)
        assert mapped.fingerprint == in_memory.fingerprint and len(mapped) == len(in_memory)
        p = mapped.plan  # the first window's Plan over the mapped lengths: no whole copy either
        assert p.lengths is mapped.lengths and np.array_equal(p.doc, in_memory.plan.doc)
        got = list(mapped)
        assert got == list(in_memory) and len(got) > 2000  # the whole epoch, window by window


def test_folder_lengths_are_never_materialised(folder, monkeypatch):
    path, _ = folder
    # the sampler's one pass over the lengths reads chunks of CHUNK (2**20) documents, more than this folder holds:
    # smaller chunks, so that a whole copy would stand out
    monkeypatch.setattr(training_lengths, "CHUNK", 1 << 14)
    topo = balancer.Topology(dp=4, cp=1, micro_batches=2, max_tokens=256, tokens_per_step=4 * 2 * 200)
    next(iter(balancer.BalancedBatchSampler(str(path), topo, COST, dp_rank=0, window_docs=1_000)))  # imports, caches
    for source in (lambda: str(path), lambda: ShardDataset(path)):
        tracemalloc.start()
        s = balancer.BalancedBatchSampler(source(), topo, COST, dp_rank=1, seed=0, window_docs=1_000)
        first = next(iter(s))
        n = len(s)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert len(first) > 0 and n > 0 and isinstance(s.lengths, ShardedArray)
        # a copy of the lengths would be N_DOCS * 8 = 1.6 MB (the doc_ids as much again); the rest of the peak is
        # planning one window (about 0.6 MB with the across-steps pass), which does not grow with the corpus
        assert peak < N_DOCS * 8 // 2, f"peak {peak / 2**20:.2f} MiB for {N_DOCS * 8 / 2**20:.2f} MiB of lengths"


def _lengths(n=900, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(1, 120, n)
    x[rng.choice(n, 15, replace=False)] = rng.integers(200, 700, 15)
    return x


@pytest.mark.parametrize("window_docs", [60, 150, 400])
@pytest.mark.parametrize("seed", [0, 3])
@pytest.mark.parametrize("overflow", ["split", "truncate"])
def test_len_is_cheap_and_exact(window_docs, seed, overflow, monkeypatch):
    topo = balancer.Topology(dp=4, cp=2, micro_batches=2, max_tokens=256, tokens_per_step=2800)
    lengths = _lengths(seed=seed)
    calls = []
    real = segments.make_plan
    monkeypatch.setattr(segments, "make_plan", lambda *a, **k: calls.append(1) or real(*a, **k))
    samplers = [
        balancer.BalancedBatchSampler(lengths, topo, COST, dp_rank=r, seed=seed, overflow=overflow,
                                      window_docs=window_docs)
        for r in range(topo.dp)
    ]  # fmt: skip
    bounds = {len(s) for s in samplers}
    assert len(bounds) == 1 and calls == []  # the same on every rank, no window planned
    windows = samplers[0].num_windows
    assert windows > 1
    for epoch in (0, 1):
        for s in samplers:
            s.set_epoch(epoch)
        bound = len(samplers[0])
        assert calls == []  # set_epoch and len plan nothing
        yielded = [len(list(s)) for s in samplers]
        assert len(set(yielded)) == 1 and yielded[0] == samplers[0].num_steps * topo.micro_batches
        assert yielded[0] == bound, (yielded[0], bound, windows)
        assert len(samplers[0]) == bound  # fixed for the epoch: planning the windows does not change it
        calls.clear()


def test_len_with_one_window_is_exact():
    topo = balancer.Topology(dp=4, cp=2, micro_batches=2, max_tokens=256, tokens_per_step=2800)
    s = balancer.BalancedBatchSampler(_lengths(), topo, COST, dp_rank=2, seed=1, overflow="split")
    assert s.num_windows == 1 and len(s) == len(list(s))


@settings(max_examples=40, deadline=None)
@given(st.integers(60, 1500), st.integers(0, 2**16), st.sampled_from([(4, 2, 2, 1), (2, 1, 3, 1), (2, 2, 4, 2)]))
def test_plan_steps_bound_bounds_the_planner(n, seed, shape):
    dp, cp, m, pp = shape
    rng = np.random.default_rng(seed)
    lengths = np.maximum(1, rng.lognormal(3.5, 1.0, n).astype(np.int64))
    topo = balancer.Topology(dp=dp, cp=cp, pp=pp, micro_batches=m, max_tokens=512 // cp,
                             tokens_per_step=int(dp * m * 512 * rng.uniform(0.4, 0.9)))  # fmt: skip
    try:
        steps = balancer.plan(lengths, topo, COST, seed=seed, overflow="split").num_steps
    except ValueError as error:  # too few documents for a step: the one refusal this shape may give
        assert "documents" in str(error), error
        assume(False)
    assert steps <= plan_steps_bound(lengths, topo, COST, "split")


def test_plan_steps_bound_with_dynamic_cp_and_fixed_rows():
    topo = balancer.Topology(dp=2, cp=2, micro_batches=2, max_tokens=256, tokens_per_step=1800, cp_sizes=(1, 2, 4))
    lengths = np.concatenate([_lengths(600), [700, 900]])
    s = balancer.BalancedBatchSampler(lengths, topo, COST, rank=1, window_docs=150)
    bound = len(s)
    assert s.num_windows == 4 and s.num_steps * topo.micro_batches <= bound
    assert len(list(s)) == s.num_steps * topo.micro_batches
    rows = np.full(5000, 100)  # fixed-length rows: the planner deals exactly equal_row_steps, the bound is exact
    static = balancer.Topology(dp=4, cp=1, micro_batches=2, max_tokens=512, tokens_per_step=8 * 300)
    assert plan_steps_bound(rows, static, COST) == balancer.plan(rows, static, COST).num_steps
