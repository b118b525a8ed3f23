"""The fit's features computed for a batch of micro-batches at once equal, bit for bit, the plain one-micro-batch
computation (the slowest rank's pairs, tokens, constant, pieces, transfers and latency count)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer import CostModel
from balancer.planning.cost.microbatch import (
    fit_features_batch,
    micro_batch_terms,
    rank_times,
    ring_moved,
    stack_terms,
    step_blocks,
)


def plain_features(terms, method, cost):
    """One micro-batch, written out: the slowest rank under `cost` (the most tokens without one), its ring steps
    charged to compute or to transfer."""
    cp = terms.cp
    times = rank_times(cost, terms, method) if cost is not None else terms.tokens
    r = int(np.argmax(times))
    if cp == 1 or method == "allgather":
        comm = (cp - 1) * terms.travel.max() if cp > 1 else 0.0
        return np.array([terms.pairs[r].sum(), terms.tokens[r], 1.0, terms.pieces[r].sum(), comm, float(cp > 1)])
    held = step_blocks(cp)[r]
    pairs, pieces, moved = terms.pairs[r, held], terms.pieces[r, held], ring_moved(terms)[r]
    if cost is None or not cost.comm_overlap:
        return np.array([pairs.sum(), terms.tokens[r], 1.0, pieces.sum(), moved.sum(), float(cp)])
    on = cost.attn_coef * pairs + cost.piece_coef * pieces >= cost.comm_coef * moved
    return np.array([pairs[on].sum(), terms.tokens[r], 1.0, pieces[on].sum(), moved[~on].sum(), float(cp)])


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from([1, 2, 4]),
    st.sampled_from(["ring", "allgather"]),
    st.sampled_from(["zigzag", "contiguous"]),
    st.integers(0, 2),
    st.lists(st.lists(st.integers(1, 900), min_size=1, max_size=6), min_size=1, max_size=8),
)
def test_batched_features_equal_one_at_a_time(cp, method, layout, which, batch):
    cost = [None, CostModel(attn_coef=1e-8, linear_coef=1e-5, fixed=1e-3, comm_coef=3e-7, piece_coef=1e-4),
            CostModel(attn_coef=1e-8, linear_coef=1e-5, comm_coef=3e-6, comm_overlap=False)][which]  # fmt: skip
    terms = [micro_batch_terms(np.array(d), cp, layout, True, None) for d in batch]
    got = fit_features_batch(stack_terms(terms), method, cost)
    want = np.array([plain_features(t, method, cost) for t in terms])
    assert got.tobytes() == want.tobytes()
