"""The one-pass window step counts (`window_step_counts`, what `len(sampler)` adds up) against the code they replace:
the chunked `inverse_small` pass with per-window minima and maxima, kept here as the reference, and the shuffle's
batched inverse walk (`EpochShuffle.positions_of_runs`) against `EpochShuffle.inverse`. Hypothesis draws the
lengths (uneven, fixed-length rows, documents over a micro-batch), window sizes, seeds, topologies and chunks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import balancer
from balancer.planning.shuffle import EpochShuffle, num_windows, window_ids
from balancer.planning.window import step_count, unit_cap, window_cut, window_step_counts


def _reference_counts(lengths, topology, *, seed, epoch, window_docs, overflow="error", chunk=1 << 20):
    """The previous implementation of `window_step_counts`, verbatim but for the statistics' last two fields."""
    n = len(lengths)
    window_docs = min(int(window_docs), n)
    k = num_windows(n, window_docs)
    cap = unit_cap(topology)
    total, units, big = (np.zeros(k, dtype=np.int64) for _ in range(3))
    low, high = np.full(k, np.iinfo(np.int64).max), np.zeros(k, dtype=np.int64)
    shuffle = EpochShuffle(n, seed, epoch) if k > 1 else None

    def sums(win, values):
        return np.rint(np.bincount(win, weights=values, minlength=k)).astype(np.int64)

    for first in range(0, n, chunk):
        raw = np.asarray(lengths[first : first + chunk], dtype=np.int64)
        win = np.zeros(len(raw), dtype=np.int64)
        if shuffle is not None:
            win = shuffle.inverse_small(np.arange(first, first + len(raw))) // window_docs
            np.minimum(win, k - 1, out=win)
        tok = raw if overflow == "split" else np.minimum(raw, cap)
        if overflow == "split" and int(raw.max()) > cap:
            rest = raw % cap
            units += sums(win, -(-raw // cap))
            big += sums(win, np.where(raw > cap, raw // cap + (2 * rest > cap), 2 * raw > cap))
            smallest, longest = np.where(raw > cap, np.where(rest > 0, rest, cap), raw), np.minimum(raw, cap)
        else:
            units += np.bincount(win, minlength=k)
            big += np.bincount(win[2 * tok > cap], minlength=k)
            smallest = longest = tok
        total += sums(win, tok)
        np.minimum.at(low, win, smallest)
        np.maximum.at(high, win, longest)
    counts = np.zeros(k, dtype=np.int64)
    for w in range(k):
        lo, hi = int(low[w]), int(high[w])
        counts[w] = step_count((int(total[w]), int(units[w]), int(big[w]), lo if lo == hi else None), topology)
    return counts


def _lengths(kind: str, n: int, cap: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "rows":
        return np.full(n, int(rng.integers(1, cap + 1)))
    if kind == "mixed_rows":  # fixed-length rows and a few shorter ones: some windows may have one length
        x = np.full(n, cap // 4)
        x[rng.choice(n, max(1, n // 50), replace=False)] = rng.integers(1, cap // 4, max(1, n // 50))
        return x
    if kind == "over":  # documents over a micro-batch, some an exact multiple of it
        x = np.maximum(1, rng.lognormal(3.0, 1.2, n).astype(np.int64))
        picks = rng.choice(n, max(1, n // 30), replace=False)
        x[picks] = rng.integers(cap + 1, 3 * cap, len(picks))
        x[picks[::3]] = 2 * cap
        return x
    return np.maximum(1, rng.lognormal(3.5, 1.1, n).astype(np.int64))


@st.composite
def cases(draw):
    dp, cp, m = draw(st.sampled_from([(2, 1, 2), (4, 2, 2), (3, 1, 3), (2, 2, 1)]))
    dynamic = draw(st.booleans()) and dp * cp >= 2
    max_tokens = draw(st.sampled_from([64, 256]))
    fill = draw(st.floats(0.3, 1.0))
    kind = draw(st.sampled_from(["lognormal", "rows", "mixed_rows", "over"]))
    n = draw(st.integers(8 * dp * m, 3000))
    window_docs = draw(st.integers(4 * dp * m, n))
    overflow = "split" if kind == "over" else draw(st.sampled_from(["split", "truncate", "error"]))
    seed, epoch = draw(st.integers(0, 2**32)), draw(st.integers(0, 5))
    chunk = draw(st.sampled_from([7, 100, 1 << 20]))
    sizes = tuple(s for s in (1, 2, 4) if (dp * cp) % s == 0) if dynamic else None
    topo = balancer.Topology(dp=dp, cp=cp, micro_batches=m, max_tokens=max_tokens,
                             tokens_per_step=max(1, int(fill * dp * cp * m * max_tokens)), cp_sizes=sizes)  # fmt: skip
    lengths = _lengths(kind, n, cp * max_tokens, np.random.default_rng(seed))
    return topo, lengths, window_docs, overflow, seed, epoch, chunk


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_counts_equal_the_previous_code(case):
    topo, lengths, window_docs, overflow, seed, epoch, chunk = case
    kwargs = dict(seed=seed, epoch=epoch, window_docs=window_docs, overflow=overflow, chunk=chunk)
    try:
        want = _reference_counts(lengths, topo, **kwargs)
    except ValueError as e:
        with pytest.raises(ValueError) as got:
            window_step_counts(lengths, topo, **kwargs)
        assert str(got.value).split(": ", 1)[-1] == str(e)  # the same refusal (the new one names the window)
        return
    try:
        got = window_step_counts(lengths, topo, **kwargs)
    except ValueError as e:  # a window whose units fragment into more micro-batches than it has documents
        assert "fragment" in str(e), e
        return
    assert got.dtype == np.int64
    # windows whose units fragment the micro-batches (balancer.planning.window.packed_cut): best-fit-decreasing's
    # count, above the previous code's, and the same as counting that window's documents alone
    raised = np.flatnonzero(got != want)
    assert (got[raised] > want[raised]).all()
    n, size = len(lengths), min(window_docs, len(lengths))
    for w in raised.tolist():
        docs = lengths[window_ids(n, seed, epoch, w, size)] if num_windows(n, size) > 1 else lengths
        assert got[w] == window_cut(docs, topo, overflow)[0]


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 5000),
    seed=st.integers(0, 2**40),
    epoch=st.integers(0, 3),
    runs=st.lists(st.integers(1, 900), min_size=1, max_size=8),
    batch=st.sampled_from([2, 5, 64, 1 << 15]),
)
def test_batched_inverse_walk_gives_every_document_its_position_once(n, seed, epoch, runs, batch):
    shuffle = EpochShuffle(n, seed, epoch)
    cuts = np.minimum(np.cumsum([0] + runs), n)
    pieces = [(int(a), np.arange(a, b) * 7 + 3) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]
    positions, values = [], []
    for p, v in shuffle.positions_of_runs(pieces, batch=batch):
        assert len(p) == len(v)
        positions.append(p)
        values.append(v)
    positions = np.concatenate(positions) if positions else np.zeros(0, dtype=np.int64)
    docs = (np.concatenate(values) - 3) // 7 if values else np.zeros(0, dtype=np.int64)
    stop = int(cuts[-1])
    assert sorted(docs.tolist()) == list(range(stop))  # every document of the runs exactly once
    assert np.array_equal(positions.astype(np.int64), shuffle.inverse(docs))  # at the position `inverse` gives


@pytest.mark.slow
def test_big_epoch_counts_equal_the_previous_code():
    """One epoch past 2**22 documents (int32 tables, chains several passes long), many windows, uneven lengths."""
    rng = np.random.default_rng(5)
    lengths = np.maximum(1, rng.lognormal(6.0, 1.3, 5_000_000).astype(np.int64))
    topo = balancer.Topology(dp=8, cp=2, micro_batches=4, max_tokens=8192)
    kwargs = dict(seed=3, epoch=1, window_docs=300_000, overflow="truncate")
    assert window_step_counts(lengths, topo, **kwargs).tolist() == _reference_counts(lengths, topo, **kwargs).tolist()
