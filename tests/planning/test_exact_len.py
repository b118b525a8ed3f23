"""`len(sampler)` is exact: every window's step count is fixed from its documents and the token budget alone (never
the cost model or rank speeds), the planner fills exactly that many steps, and `len()` plans nothing. Property tests
over fills up to the whole capacity, window sizes, dynamic CP, pipelines, overflow policies and uneven lengths."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.coverage import covered_tokens

import balancer
from balancer.planning.shuffle import num_windows, window_ids
from balancer.planning.window import plan_window, window_step_count, window_step_counts
from balancer.training import segments

COST = balancer.CostModel(attn_coef=1.0, linear_coef=50.0)


def _lengths(kind: str, n: int, cap: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "rows":  # fixed-length rows
        return np.full(n, int(rng.integers(1, cap // 2 + 1)))
    if kind == "heavy":  # a thin tail of documents near a micro-batch, most of them short
        x = np.maximum(1, rng.lognormal(2.5, 1.0, n).astype(np.int64))
        x[rng.choice(n, max(1, n // 40), replace=False)] = rng.integers(cap // 2, cap + 1, max(1, n // 40))
        return np.minimum(x, 3 * cap)
    if kind == "mixed_rows":  # fixed-length rows and a few shorter ones (the last row of each source)
        x = np.full(n, cap // 4)
        x[rng.choice(n, max(1, n // 10), replace=False)] = rng.integers(1, cap // 4, max(1, n // 10))
        return x
    return np.maximum(1, rng.lognormal(3.5, 1.1, n).astype(np.int64))


@st.composite
def cases(draw):
    dp, cp, m, pp = draw(st.sampled_from([(2, 1, 2, 1), (4, 2, 2, 1), (2, 2, 2, 2), (3, 1, 3, 1), (2, 1, 4, 3)]))
    dynamic = draw(st.booleans()) and dp * cp >= 2
    max_tokens = draw(st.sampled_from([128, 256]))
    fill = draw(st.floats(0.3, 1.0))
    capacity = dp * cp * m * max_tokens
    kind = draw(st.sampled_from(["lognormal", "heavy", "rows", "mixed_rows"]))
    n = draw(st.integers(40 * dp * m, 1200))
    window_docs = draw(st.integers(dp * m, n))
    overflow = draw(st.sampled_from(["split", "truncate"]))
    seed = draw(st.integers(0, 2**20))
    sizes = tuple(s for s in (1, 2, 4) if (dp * cp) % s == 0) if dynamic else None
    topo = balancer.Topology(dp=dp, cp=cp, pp=pp, micro_batches=m, max_tokens=max_tokens,
                             tokens_per_step=max(1, int(fill * capacity)), cp_sizes=sizes)  # fmt: skip
    rng = np.random.default_rng(seed)
    return topo, _lengths(kind, n, cp * max_tokens, rng), window_docs, overflow, seed


def _ranks(topo: balancer.Topology) -> list[dict]:
    if topo.dynamic:
        return [{"rank": r} for r in range(topo.pool_size)]
    return [{"dp_rank": r} for r in range(topo.dp)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(case=cases())
def test_len_equals_what_every_rank_yields(case):
    topo, lengths, window_docs, overflow, seed = case
    calls = []
    real = segments.make_plan
    segments.make_plan = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        samplers = [
            balancer.BalancedBatchSampler(lengths, topo, COST, seed=seed, overflow=overflow, window_docs=window_docs,
                                          **where)
            for where in _ranks(topo)
        ]  # fmt: skip
        sizes = {len(s) for s in samplers}
    except ValueError as e:  # too few documents for a step of this topology: refused up front, naming the numbers
        assert "micro-batches" in str(e) or "window_docs" in str(e), e
        return
    finally:
        segments.make_plan = real
    several = samplers[0].num_windows > 1
    assert len(sizes) == 1 and (calls == [] or not several)  # the same on every rank; planned nothing
    n = sizes.pop()
    items = []
    for s in samplers:
        got = list(s)
        assert len(got) == n, (len(got), n, s.num_windows)
        items += [i for mb in got for i in mb]
    assert samplers[0].num_steps * topo.micro_batches == n
    # every document (every token of it, split or not) exactly once over all ranks; truncated ones up to the cap
    want = covered_tokens(range(len(lengths)), np.minimum(lengths, _cap(topo)) if overflow == "truncate" else lengths)
    if topo.dynamic:  # the CP ranks of one group all get its micro-batch: count each group once
        items = [i for s in samplers for mb in s for i in mb if i.group.rank == 0]
    assert covered_tokens(items, lengths) == want


def _cap(topo: balancer.Topology) -> int:
    return topo.max_tokens * (topo.largest_group if topo.dynamic else topo.cp)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_window_counts_in_one_pass_match_each_window(case):
    topo, lengths, window_docs, overflow, seed = case
    window_docs = min(window_docs, len(lengths) - 1)
    try:
        counts = window_step_counts(lengths, topo, seed=seed, epoch=2, window_docs=window_docs, overflow=overflow,
                                    chunk=97)  # fmt: skip
    except ValueError:
        return
    k = num_windows(len(lengths), window_docs)
    assert len(counts) == k
    for w in range(k):
        ids = window_ids(len(lengths), seed, 2, w, window_docs)
        assert counts[w] == window_step_count(lengths[ids], topo, overflow)
        if k > 1:
            p = plan_window(lengths, topo, COST, seed=seed, epoch=2, index=w, window_docs=window_docs,
                            overflow=overflow)  # fmt: skip
            assert p.num_steps == counts[w]
            p.validate()


def test_the_count_ignores_the_cost_model():
    rng = np.random.default_rng(5)
    lengths = _lengths("heavy", 3000, 512, rng)
    topo = balancer.Topology(dp=4, cp=2, pp=2, micro_batches=2, max_tokens=256, tokens_per_step=int(0.95 * 4096))
    attention_bound = balancer.CostModel(attn_coef=1.0, linear_coef=1.0)
    linear_bound = balancer.CostModel(attn_coef=1e-6, linear_coef=1.0, fixed=3.0)
    a, b = (balancer.BalancedBatchSampler(lengths, topo, c, dp_rank=1, window_docs=400, overflow="split")
            for c in (attention_bound, linear_bound))  # fmt: skip
    assert len(a) == len(b) == len(list(a)) == len(list(b))
    for w in range(a.num_windows):
        assert a.windows.steps(w) == b.windows.steps(w)


def test_len_and_num_steps_plan_nothing_with_many_windows(monkeypatch):
    calls = []
    real = segments.make_plan
    monkeypatch.setattr(segments, "make_plan", lambda *a, **k: calls.append(1) or real(*a, **k))
    lengths = np.random.default_rng(0).integers(1, 200, 20_000)
    topo = balancer.Topology(dp=4, cp=1, micro_batches=2, max_tokens=512, tokens_per_step=3000)
    s = balancer.BalancedBatchSampler(lengths, topo, COST, dp_rank=3, window_docs=700)
    assert s.num_windows > 20
    n, steps, later = len(s), s.num_steps, s.epoch_num_steps(4)
    assert calls == [] and n == steps * topo.micro_batches and later > 0
    assert s.micro_batch(steps - 1, 1) and calls  # the last step exists (its window planned now)
    with pytest.raises(IndexError):
        s.micro_batch(steps, 0)
