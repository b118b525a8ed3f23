"""`peak_buffered_tokens` after `set_epoch` mid-pass (or a new `iter()` mid-pass) while the background thread
reads or plans a window of the old pass. Old: the old pass's buffered rows (its window's rows not yet yielded, the
reader's read-ahead, and what the job in flight read) stayed counted as held for the rest of the stream's life: after
a whole new pass the stream still counted 2,800-3,700 tokens as held and the peak reached 7,549-8,442 against 4,746
for the same pass read alone. New: each pass counts its own tokens and gives them back when it is left; the job in
flight counts nothing once its pass is over."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import balancer
from balancer.streaming import BalancedStream

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "streaming"))
from stream_cases import doc_rows  # noqa: E402

TOPO = balancer.Topology(dp=1, micro_batches=2, max_tokens=512)
COST = balancer.CostModel(1.0, 50.0)
ROWS = doc_rows(100, 0)


def _alone_peak() -> int:
    with BalancedStream(ROWS, TOPO, COST, window_docs=24) as s:
        s.set_epoch(1)
        assert sorted(r["doc"] for mb in s for r in mb) == list(range(100))
        assert s.meter.now == 0  # a pass read to its end holds nothing
        return s.meter.peak


@pytest.mark.parametrize("read", [1, 3, 10])  # micro-batches of epoch 0 read first (a window job then in flight)
@pytest.mark.parametrize("how", ["set_epoch", "iter"])
def test_leaving_a_pass_gives_its_buffered_tokens_back(read, how):
    alone = _alone_peak()
    with BalancedStream(ROWS, TOPO, COST, window_docs=24) as s:
        it = iter(s)
        for _ in range(read):
            next(it)
        before = s.meter.peak
        assert s.meter.now > 0  # rows of the window being read are held
        if how == "set_epoch":
            s.set_epoch(1)
        docs = sorted(r["doc"] for mb in s for r in mb)  # a new pass (of epoch 1, or again of epoch 0)
        assert docs == list(range(100))
        assert s.meter.now == 0, "the old pass's tokens are still counted as held"
        if how == "set_epoch":
            assert s.meter.peak <= max(before, alone), (s.meter.peak, before, alone)
        assert s.stats()["peak_buffered_tokens"] == s.meter.peak
