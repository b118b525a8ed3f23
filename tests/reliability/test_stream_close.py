"""BalancedStream.close(), `with BalancedStream(...)`, and teardown on garbage collection: the background thread
ends (after the window job in flight) and the stream yields nothing more; in a spawned world the stream's own
process group is released and a world that breaks early exits cleanly."""

from __future__ import annotations

import gc
import os
import sys
import threading
import weakref
from pathlib import Path

import pytest

import balancer
from balancer.streaming import BalancedStream
from balancer.streaming.teardown import StreamClosed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "streaming"))
from stream_cases import doc_rows  # noqa: E402

TOPO = balancer.Topology(dp=1, micro_batches=2, max_tokens=512)
COST = balancer.CostModel(1.0, 50.0)


def _stream_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "balancer-stream" and t.is_alive()]


def test_close_ends_the_thread_and_refuses_more():
    before = len(_stream_threads())
    s = BalancedStream(doc_rows(200, 0), TOPO, COST, window_docs=24)
    it = iter(s)
    for _ in range(7):  # mid-window: the next window's job was handed to the thread
        next(it)
    assert len(_stream_threads()) == before + 1
    s.close()
    assert len(_stream_threads()) == before  # old: no close(); the thread lived until the process ended
    with pytest.raises(StreamClosed, match="closed"):
        next(it)
    with pytest.raises(StreamClosed, match="closed"):
        iter(s)
    s.close()  # idempotent
    assert s.state_dict()["position"] >= 0  # the state of where it stopped is still there (main-thread only)


def test_with_statement_closes():
    before = len(_stream_threads())
    with BalancedStream(doc_rows(100, 1), TOPO, COST, window_docs=24) as s:
        first = next(iter(s))
        assert first and len(_stream_threads()) == before + 1
    assert len(_stream_threads()) == before
    with pytest.raises(StreamClosed):
        list(s)


def test_a_dropped_stream_is_torn_down_by_the_garbage_collector():
    before = len(_stream_threads())
    s = BalancedStream(doc_rows(100, 2), TOPO, COST, window_docs=24)
    it = iter(s)
    next(it)
    ref = weakref.ref(s)
    del s, it
    gc.collect()
    assert ref() is None  # nothing (the thread, the finaliser) keeps the stream alive
    assert len(_stream_threads()) == before


def test_a_full_pass_then_close_keeps_every_document():
    rows = doc_rows(60, 3)
    with BalancedStream(rows, TOPO, COST, window_docs=24) as s:
        out = list(s)
    assert sorted(r["doc"] for mb in out for r in mb) == list(range(60))


@pytest.mark.slow  # spawned gloo worlds: about a minute on 2 cores
@pytest.mark.parametrize("ranks", [2, 4])
def test_a_world_that_breaks_early_exits_cleanly(tmp_path, ranks):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import stream_exit

    data = stream_exit.write_dataset(tmp_path, docs=3000)
    repo = Path(__file__).resolve().parents[2]
    for _ in range(2):
        run = stream_exit.run_world(repo, data, "stream", ranks)
        assert run["clean"], run  # old: some runs ended with SIGABRT (exit code -6)
    assert os.path.exists(data)
