"""The replica refinement's search on Python lists (balancer/planning/packing/refine_small.py) makes, round after
round, the very change the NumPy search (refine._improve without trades) makes, on random steps with tied costs,
tied replica times and token-full micro-batches; and the refinement of whole epochs is the same with either."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import balancer
from balancer.planning.packing import refine
from balancer.planning.packing.refine import _improve, _State, refine_packed
from balancer.planning.packing.refine_small import SmallState, improve_small


def _step(rng, dp: int, m: int, n: int, grain: int, cap: int):
    """A step: n units dealt first-fit in random order to dp * m micro-batches (each non-empty; within cap where a
    micro-batch has room, so many are nearly token-full), unbalanced."""
    nb = dp * m
    most = cap // max(2, -(-n // nb) - 1)
    tok = (rng.integers(1, most // grain + 1, n) * grain).clip(1, most)
    cost = tok + 3.7e-5 * tok.astype(np.float64) ** 2
    if grain > 1:
        cost = np.round(cost / 100) * 100  # exact ties between units and between replica sums
    mb = np.empty(n, dtype=np.int64)
    used = np.zeros(nb, dtype=np.int64)
    for i in range(n):
        room = np.flatnonzero(used + tok[i] <= cap)
        choice = i if i < nb else int(rng.choice(room)) if len(room) else int(np.argmin(used))
        mb[i], used[choice] = choice, used[choice] + tok[i]
    return mb, cost, tok


@settings(max_examples=200, deadline=None)
@given(
    dp=st.integers(2, 8),
    m=st.sampled_from([1, 2, 3, 4]),
    per_bin=st.integers(1, 6),
    grain=st.sampled_from([1, 50, 400]),
    seed=st.integers(0, 2**31),
)
def test_same_change_every_round(dp, m, per_bin, grain, seed):
    rng = np.random.default_rng(seed)
    cap = 4096
    mb, cost, tok = _step(rng, dp, m, dp * m * per_bin, grain, cap)
    ref, small = _State(mb.copy(), cost, tok, dp, m), SmallState(mb.copy(), cost, tok, dp, m)
    changed = 0
    for _ in range(60):
        done = _improve(ref, cap)
        assert improve_small(small, cap) == done
        np.testing.assert_array_equal(np.array(small.mb), ref.mb)
        assert small.times == ref.times.tolist()
        if not done:
            break
        changed += 1
    assert changed == 0 or not np.array_equal(ref.mb, mb)  # a change moved a unit


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), dp=st.sampled_from([2, 4, 8]), m=st.sampled_from([1, 2, 4]))
def test_refined_epoch_the_same_with_either_search(seed, dp, m):
    rng = np.random.default_rng(seed)
    topo = balancer.Topology(dp=dp, micro_batches=m, max_tokens=4096)
    n = dp * m * 3
    steps = [_step(rng, dp, m, n, 1, 4096) for _ in range(4)]
    u_cost = np.concatenate([cost for _, cost, _ in steps])
    u_tok = np.concatenate([tok for _, _, tok in steps])
    pieces = []
    for s, (mb, _, _) in enumerate(steps):
        order = np.argsort(mb, kind="stable")
        pieces.append((s * n + order, np.bincount(mb, minlength=dp * m)[None, :]))
    saved = refine.SMALL_STEP
    try:
        refine.SMALL_STEP = 0  # every step through the NumPy search
        ref = refine_packed(pieces, u_cost, u_tok, topo)
    finally:
        refine.SMALL_STEP = saved
    ours = refine_packed(pieces, u_cost, u_tok, topo)
    assert any(not np.array_equal(u, p[0]) for (u, _), p in zip(ref, pieces))  # the refinement changed a step
    for (u_ref, s_ref), (u_ours, s_ours) in zip(ref, ours):
        np.testing.assert_array_equal(u_ours, u_ref)
        np.testing.assert_array_equal(s_ours, s_ref)
