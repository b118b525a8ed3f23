"""The planner's batched pieces against their one-at-a-time definitions: the local search over many steps at once
equals it run step by step, pack_step's few-micro-batch dealing equals the NumPy rounds, and the short-axis
reductions and blocked products equal NumPy's."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import balancer.planning.packing.step as binpack
from balancer import Topology
from balancer.planning.packing.rowops import argmin_last, last_axis, product
from balancer.planning.packing.search import polish, polish_steps
from balancer.planning.packing.step import pack_step, step_time


def random_steps(rng: np.random.Generator, topo: Topology, steps: int):
    """Steps of random units, each placed in a random micro-batch with room (every micro-batch filled)."""
    nb, cap = topo.bins_per_step, topo.micro_batch_tokens
    cost, tokens, unit_bin, ptr = [], [], [], [0]
    for _ in range(steps):
        n = int(rng.integers(nb, 3 * nb + 1))
        tok = rng.integers(1, cap // 4 + 1, n)
        bins, used = np.arange(n) % nb, np.zeros(nb, dtype=np.int64)
        for i in range(n):  # the first nb units one per micro-batch, the rest to a random one with room
            if i >= nb:
                bins[i] = rng.choice(np.flatnonzero(used + tok[i] <= cap))
            used[bins[i]] += tok[i]
        cost.append(tok * (1 + tok / float(rng.choice([500, 5000]))))
        tokens.append(tok)
        unit_bin.append(bins)
        ptr.append(ptr[-1] + n)
    return np.concatenate(cost), np.concatenate(tokens), np.concatenate(unit_bin), np.array(ptr)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    shape=st.sampled_from([(1, 4, 1), (2, 2, 1), (4, 2, 1), (2, 4, 2), (4, 2, 4), (3, 1, 1)]),
)
def test_batched_search_equals_searching_each_step_alone(seed, shape):
    dp, m, pp = shape
    topo = Topology(dp=dp, micro_batches=m, pp=pp, max_tokens=4096)
    rng = np.random.default_rng(seed)
    cost, tokens, unit_bin, ptr = random_steps(rng, topo, steps=12)
    batched = unit_bin.copy()
    polish_steps(batched, cost, tokens, ptr, np.arange(12), topo)
    for s in range(12):
        part = slice(ptr[s], ptr[s + 1])
        alone = unit_bin[part].copy()
        polish(alone, cost[part], tokens[part], topo)
        assert np.array_equal(alone, batched[part])
        assert step_time(alone, cost[part], topo) <= step_time(unit_bin[part], cost[part], topo)  # never worse
        counts = np.bincount(alone, minlength=topo.bins_per_step)
        used = np.bincount(alone, weights=tokens[part], minlength=topo.bins_per_step)
        assert counts.min() >= 1 and used.max() <= topo.micro_batch_tokens  # no empty or overfull micro-batch


def test_batched_search_lowers_the_steps_it_is_given_only():
    topo = Topology(dp=4, micro_batches=2, max_tokens=4096)
    cost, tokens, unit_bin, ptr = random_steps(np.random.default_rng(3), topo, steps=8)
    searched = unit_bin.copy()
    polish_steps(searched, cost, tokens, ptr, np.array([1, 5]), topo)
    moved = np.flatnonzero(searched != unit_bin)
    assert len(moved) and np.all(((moved >= ptr[1]) & (moved < ptr[2])) | ((moved >= ptr[5]) & (moved < ptr[6])))


@pytest.mark.parametrize("dp,m,pp", [(1, 4, 1), (2, 4, 1), (4, 4, 1), (2, 2, 4), (1, 8, 2)])
def test_few_micro_batch_dealing_places_as_the_numpy_rounds(monkeypatch, dp, m, pp):
    """pack_step deals light units on Python floats for steps of few micro-batches: the same placements as the
    NumPy rounds, also when micro-batches run out of token room (misfits, spills)."""
    rng = np.random.default_rng(dp * 100 + m * 10 + pp)
    for cap, n in ((1 << 14, 60), (1 << 12, 200), (1 << 16, 3000)):
        topo = Topology(dp=dp, micro_batches=m, pp=pp, max_tokens=cap)
        tokens = np.minimum(rng.lognormal(np.log(cap / 12), 1.0, n).astype(np.int64) + 1, cap)
        cost = tokens * (1 + tokens / 2000.0)
        monkeypatch.setattr(binpack, "FEW_BINS", 64)
        python = pack_step(cost, tokens, topo)
        monkeypatch.setattr(binpack, "FEW_BINS", 0)
        numpy_rounds = pack_step(cost, tokens, topo)
        assert np.array_equal(python, numpy_rounds)


@pytest.mark.parametrize("width", [1, 2, 3, 8, 9, 40])
def test_short_axis_reductions_equal_numpy(width):
    rng = np.random.default_rng(width)
    values = rng.integers(0, 4, (50, 7, width)).astype(np.float64)  # many ties
    values[0, 0, :] = np.inf
    for ufunc in (np.add, np.minimum, np.maximum):
        assert np.array_equal(last_axis(ufunc, values), ufunc.reduce(values, axis=-1))
    assert np.array_equal(argmin_last(values), np.argmin(values, axis=-1))


@pytest.mark.parametrize("rows,k,cols", [(1, 3, 4), (700, 16, 64), (5000, 8, 16), (33, 64, 1024)])
def test_blocked_product_equals_matmul(rows, k, cols):
    rng = np.random.default_rng(rows)
    left, right = rng.integers(0, 50, (rows, k)).astype(np.float64), rng.integers(0, 50, (k, cols)).astype(np.float64)
    assert np.array_equal(product(left, right), left @ right)  # integer-valued: exact in any summation order


def _improving_neighbour(unit_bin, cost, tokens, topo) -> bool:
    """Brute force: does any single move or swap of a unit of the slowest replica lower the step time?"""
    nb, m, cap = topo.bins_per_step, topo.micro_batches, topo.micro_batch_tokens
    now = step_time(unit_bin, cost, topo)
    per_replica = np.bincount(unit_bin, weights=cost, minlength=nb).reshape(topo.dp, m)
    replica_time = (topo.pp - 1) * per_replica.max(axis=1) + per_replica.sum(axis=1)
    slowest = int(np.argmax(replica_time))
    for i in np.flatnonzero(unit_bin // m == slowest):
        for j in range(nb):  # moves (inside the replica only with pipeline stages)
            trial = unit_bin.copy()
            trial[i] = j
            inside = j // m == slowest
            if j == unit_bin[i] or (inside and topo.pp == 1) or np.bincount(trial, minlength=nb).min() == 0:
                continue
            if np.bincount(trial, weights=tokens, minlength=nb).max() <= cap and step_time(trial, cost, topo) < now * (
                1 - 1e-6
            ):
                return True
        for k in np.flatnonzero(unit_bin // m != slowest):  # swaps with a unit of another replica
            trial = unit_bin.copy()
            trial[i], trial[k] = unit_bin[k], unit_bin[i]
            fits = np.bincount(trial, weights=tokens, minlength=nb).max() <= cap
            if fits and step_time(trial, cost, topo) < now * (1 - 1e-6):
                return True
    return False


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), shape=st.sampled_from([(2, 2, 1), (4, 2, 1), (2, 4, 2), (3, 2, 4)]))
def test_search_ends_where_no_move_or_swap_helps(seed, shape):
    """After the search (rounds to spare), no single move or swap of a unit of the slowest replica lowers the step
    time: checked by brute force over every neighbour."""
    dp, m, pp = shape
    topo = Topology(dp=dp, micro_batches=m, pp=pp, max_tokens=4096)
    cost, tokens, unit_bin, ptr = random_steps(np.random.default_rng(seed), topo, steps=4)
    polish_steps(unit_bin, cost, tokens, ptr, np.arange(4), topo, rounds=500)
    for s in range(4):
        part = slice(ptr[s], ptr[s + 1])
        assert not _improving_neighbour(unit_bin[part], cost[part], tokens[part], topo)
