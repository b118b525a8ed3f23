"""Hostile use of a stream's passes: `set_epoch` and a new `iter()` many times at random points of a pass (before
the first micro-batch, mid-window, at a window's end, after the pass), several iterators left open, then a full pass:
it must yield every document exactly once, hold no tokens after it and keep its peak within two passes' worth (a
stream has no `len()`: its source's length is not known before it is read). Outcome: held (no loss, no leak, no
hang) on the code of this round; these tests guard it."""

from __future__ import annotations

import sys
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import balancer
from balancer.streaming import BalancedStream

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "streaming"))
from stream_cases import doc_rows  # noqa: E402

TOPO = balancer.Topology(dp=1, micro_batches=2, max_tokens=512)
COST = balancer.CostModel(1.0, 50.0)
ROWS = doc_rows(60, 0)


def _full_pass(s: BalancedStream) -> list:
    return sorted(r["doc"] for mb in s for r in mb)


def _alone_peak() -> int:
    with BalancedStream(ROWS, TOPO, COST, window_docs=16) as s:
        assert _full_pass(s) == list(range(60))
        return s.meter.peak


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(moves=st.lists(st.tuples(st.sampled_from(["set_epoch", "iter"]), st.integers(0, 40)), min_size=1, max_size=6))
def test_many_restarts_mid_pass_lose_and_hold_nothing(moves):
    alone = _alone_peak()
    with BalancedStream(ROWS, TOPO, COST, window_docs=16) as s:
        open_iters = []
        for epoch, (how, read) in enumerate(moves):
            if how == "set_epoch":
                s.set_epoch(epoch % 3)
            it = iter(s)
            open_iters.append(it)
            for _ in range(read):
                if next(it, None) is None:
                    break
        s.set_epoch(7)
        assert _full_pass(s) == list(range(60))
        assert s.meter.now == 0, "tokens of a left pass are still counted as held"
        assert s.meter.peak <= 2 * alone, (s.meter.peak, alone)


def test_set_epoch_at_every_point_of_a_pass():
    with BalancedStream(ROWS, TOPO, COST, window_docs=16) as s:
        s.set_epoch(2)
        whole = [mb for mb in s]
        total = len(whole)
        for stop in (0, 1, total // 2, total - 1, total):
            s.set_epoch(3)
            it = iter(s)
            for _ in range(stop):
                next(it)
            s.set_epoch(2)  # back to epoch 2: a new pass from its start, the same micro-batches
            again = [mb for mb in s]
            assert [[r["doc"] for r in mb] for mb in again] == [[r["doc"] for r in mb] for mb in whole]
            assert s.meter.now == 0
