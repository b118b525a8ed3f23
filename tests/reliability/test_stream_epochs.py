"""set_epoch at every point of a pass: a state saved after set_epoch resumes the new pass whole (old: the old
pass's end, labelled with the new epoch: every document of the new pass lost), and the old pass's iterator ends
with a clear error instead of yielding windows planned with the new epoch's seeds."""

from __future__ import annotations

import json
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


def _docs(batches) -> list[int]:
    return sorted(r["doc"] for mb in batches for r in mb)


@pytest.mark.parametrize("read", [0, 3, 10, None])  # micro-batches of epoch 0 read first (None: all of them)
def test_state_after_set_epoch_resumes_the_whole_new_pass(read):
    s = BalancedStream(ROWS, TOPO, COST, window_docs=24)
    it = iter(s)
    for _ in range(10**6 if read is None else read):
        try:
            next(it)
        except StopIteration:
            break
    s.set_epoch(1)
    state = json.loads(json.dumps(s.state_dict()))
    assert state["epoch"] == 1 and state["position"] == 0
    resumed = BalancedStream(ROWS, TOPO, COST, window_docs=24)
    resumed.load_state_dict(state)
    reference = BalancedStream(ROWS, TOPO, COST, window_docs=24)
    reference.set_epoch(1)
    assert _docs(resumed) == list(range(100))
    assert [[r["doc"] for r in mb] for mb in resumed] == [[r["doc"] for r in mb] for mb in reference]


def test_the_old_pass_ends_with_an_error_after_set_epoch():
    s = BalancedStream(ROWS, TOPO, COST, window_docs=24)
    it = iter(s)
    next(it)
    s.set_epoch(1)
    with pytest.raises(RuntimeError, match=r"set_epoch\(1\) was called while this pass \(epoch 0\)"):
        next(it)  # old: went on yielding epoch 0's documents in windows planned with epoch 1's seeds
    assert _docs(s) == list(range(100))  # the new pass is whole
    s.set_epoch(1)  # the same epoch again: nothing changes
