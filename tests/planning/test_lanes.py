"""The batched packing's faster layouts give the very placements and orders of the plain row-by-row versions:
`pack_even_steps` (count-ordered, micro-batch-major arrays) against a reference of the row layout kept here,
`by_step_grid` with tokens (sorted as small integers) against the stable float sort, `by_micro_batch` against one
sort of the whole epoch, and `assign_steps`'s search of step ends against `np.searchsorted`. Random steps with tied
costs, token-full micro-batches, uneven step sizes and pipelines."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer.planning.metrics import one_f_one_b
from balancer.planning.packing.epoch import TAIL_ROUNDS, by_micro_batch, by_step_grid, pack_steps
from balancer.planning.steps import _steps_passed
from balancer.planning.topology import Topology


def _reference_pack(cost, tokens, ptr, topology: Topology) -> np.ndarray:
    """The row layout: [step, micro-batch] arrays, every step's rows gathered where it takes part."""
    nb, cap, m, dp = topology.bins_per_step, topology.micro_batch_tokens, topology.micro_batches, topology.dp
    steps, counts = len(ptr) - 1, np.diff(ptr)
    grid = by_step_grid(-cost, ptr)
    load, used = np.zeros((steps, nb)), np.zeros((steps, nb), dtype=np.int64)
    unit_bin = np.full(len(cost), -1, dtype=np.int64)

    def place(u, s, b):
        unit_bin[u], load[s, b], used[s, b] = b, load[s, b] + cost[u], used[s, b] + tokens[u]

    spread = (np.arange(nb) % m) * (nb // m) + np.arange(nb) // m
    for first in range(0, grid.shape[1], nb):
        for s in range(steps):
            chunk = [u for u in grid[s, first : first + nb] if u >= 0]
            if counts[s] - first >= TAIL_ROUNDS * nb:  # a round: least loaded first, ties across replicas
                target = np.lexsort((spread, load[s]))[: len(chunk)]
                misfits = []
                for u, b in zip(chunk, target):
                    (place(u, s, b) if used[s, b] + tokens[u] <= cap else misfits.append(u))
                for u in misfits:
                    room = used[s] + tokens[u] <= cap
                    if room.any():
                        place(u, s, int(np.argmin(np.where(room, load[s], np.inf))))
                continue
            for u in chunk:  # the tail: one at a time
                room = (used[s] + tokens[u] <= cap).reshape(dp, m)
                per = load[s].reshape(dp, m)
                if topology.pp == 1:
                    total = np.where(room.any(axis=1), per.sum(axis=1), np.inf)
                    r = int(np.argmin(total))
                    if np.isfinite(total[r]):
                        place(u, s, r * m + int(np.argmin(np.where(room[r], per[r], np.inf))))
                    continue
                c = cost[u]
                new = one_f_one_b(np.maximum(per.max(axis=1, keepdims=True), per + c), per.sum(axis=1)[:, None] + c,
                                  topology.pp)  # fmt: skip
                new = np.where(room, new, np.inf).ravel()
                if np.isfinite(new.min()):
                    place(u, s, int(np.argmin(np.where(new <= new.min() * (1 + 1e-12), load[s], np.inf))))
    return unit_bin


@st.composite
def epochs(draw):
    dp, m, pp = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.sampled_from([1, 1, 2]))
    topo = Topology(dp=dp, micro_batches=max(m, pp), pp=pp, max_tokens=draw(st.sampled_from([600, 1000, 4096])))
    sizes = draw(st.lists(st.integers(0, 7 * topo.bins_per_step), min_size=1, max_size=12))
    ptr = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    grain = draw(st.sampled_from([1, 50, 200]))
    tokens = (rng.integers(1, topo.micro_batch_tokens // grain + 1, int(ptr[-1])) * grain).clip(1, None)
    cost = tokens + 3e-4 * tokens.astype(np.float64) ** 2
    return cost, tokens, ptr, topo


@settings(max_examples=80, deadline=None)
@given(epochs())
def test_even_packing_is_the_row_layouts(epoch):
    cost, tokens, ptr, topo = epoch
    if ptr[-1] == 0:
        return
    assert np.array_equal(pack_steps(cost, tokens, ptr, topo), _reference_pack(cost, tokens, ptr, topo))


@settings(max_examples=80, deadline=None)
@given(epochs(), st.booleans())
def test_grid_sorted_as_integers_is_the_stable_sort(epoch, rounded):
    cost, tokens, ptr, _ = epoch
    if ptr[-1] == 0:
        return
    key = -(np.round(cost / 500) if rounded else cost)  # rounded: ties between units of different tokens
    assert np.array_equal(by_step_grid(key, ptr, tokens), by_step_grid(key, ptr))
    odd = key.copy()
    odd[0] += 1.0  # no longer a function of tokens where another unit has the same tokens: the float sort
    assert np.array_equal(by_step_grid(odd, ptr, tokens), by_step_grid(odd, ptr))


def test_grid_with_a_key_not_a_function_of_tokens_falls_back():
    ptr = np.array([0, 3, 5])
    tokens = np.array([5, 5, 7, 7, 1])
    key = np.array([2.0, 1.0, 3.0, 3.0, 0.0])  # two units of 5 tokens with different keys
    assert by_step_grid(key, ptr, tokens).tolist() == [[1, 0, 2], [4, 3, -1]]


@settings(max_examples=80, deadline=None)
@given(epochs(), st.booleans())
def test_by_micro_batch_is_one_sort_of_the_epoch(epoch, shuffled):
    _, tokens, ptr, topo = epoch
    nb, n, steps = topo.bins_per_step, int(ptr[-1]), len(ptr) - 1
    rng = np.random.default_rng(n)
    flat = rng.permutation(n + 5)[:n]
    if not shuffled:  # steps cut from the shuffled order: ascending inside each step
        flat = np.concatenate([np.sort(flat[ptr[s] : ptr[s + 1]]) for s in range(steps)]).astype(np.int64)
    unit_bin = rng.integers(-1, nb, n)
    slot = np.repeat(np.arange(steps), np.diff(ptr)) * (nb + 1) + unit_bin + 1
    by_bin, sizes = by_micro_batch(flat, ptr, unit_bin, nb)
    assert np.array_equal(by_bin, flat[np.lexsort((flat, slot))])
    assert np.array_equal(sizes, np.bincount(slot, minlength=steps * (nb + 1)).reshape(steps, nb + 1)[:, 1:])


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=60), st.lists(st.integers(0, 400), min_size=1, max_size=8))
def test_steps_passed_is_searchsorted(tokens, budget):
    tok = np.array(tokens, dtype=np.float64)
    middle = np.cumsum(tok) - tok / 2
    ends = np.cumsum(np.array(budget, dtype=np.float64))
    assert np.array_equal(_steps_passed(ends, middle), np.searchsorted(ends, middle, side="right"))
