"""Hostile stream sources on two gloo processes: a source that changes between epochs (other documents, fewer, none,
fewer than a step's micro-batches, fewer than the replicas), one that raises mid-window in a later window and a later
epoch on one rank, and one whose rows cannot be pickled on one rank. Every pass yields exactly the documents its
source gave, once, with equal counts on both ranks, and every failure reaches both ranks as the same kind of error
(old: an unpicklable row failed on its own rank only, and the other waited in the document exchange until that
process exited or for the stream group's timeout, 30 minutes)."""

from __future__ import annotations

import pickle
import sys
import threading
from pathlib import Path

import pytest
from support.dist import run_world

import balancer
from balancer.streaming import BalancedStream

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "streaming"))
from stream_cases import doc_rows  # noqa: E402

pytestmark = pytest.mark.slow  # two spawned gloo processes per test

TOPO = balancer.Topology(dp=2, micro_batches=2, max_tokens=512)
COST = balancer.CostModel(1.0, 50.0)
ROWS = doc_rows(150, 2)


class EpochRows:
    """A re-iterable source whose documents depend on the epoch (`set_epoch`, which the stream forwards): epoch e
    gives `plan[e]` (a slice of ROWS); it raises OSError on rank `fail_rank` at item `fail_at` of `fail_epoch`."""

    def __init__(self, plan: dict, fail: tuple = (None, None, None)) -> None:
        self.plan, self.epoch = plan, 0
        self.fail_epoch, self.fail_rank, self.fail_at = fail

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        import torch.distributed as dist

        for i, row in enumerate(self.plan[self.epoch]):
            if (self.epoch, dist.get_rank(), i) == (self.fail_epoch, self.fail_rank, self.fail_at):
                raise OSError(f"source gone at item {i} (test)")
            yield row


PLAN = {0: ROWS, 1: ROWS[20:90], 2: ROWS[:3], 3: [], 4: ROWS[:1], 5: ROWS[100:]}


def _pass(stream: BalancedStream, epoch: int) -> dict:
    stream.set_epoch(epoch)
    got = []
    try:
        for mb in stream:
            got.append([r["doc"] for r in mb])
        return {"batches": got, "error": None}
    except Exception as e:
        return {"batches": got, "error": f"{type(e).__name__}: {e}"}


def _changing_rank(rank: int, world: int, out: str) -> None:
    with BalancedStream(EpochRows(PLAN, fail=(5, 1, 31)), TOPO, COST, window_docs=16, timeout=60) as stream:
        result = {epoch: _pass(stream, epoch) for epoch in PLAN}
    Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


def test_a_source_that_changes_between_epochs_and_fails_in_a_later_one(tmp_path):
    run_world(2, _changing_rank, str(tmp_path))
    results = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(2)]
    for epoch in (0, 1, 2):  # 2: three documents, less than a step's 2 x 2 micro-batches: one short step
        want = sorted(r["doc"] for r in PLAN[epoch])
        assert all(res[epoch]["error"] is None for res in results), [res[epoch]["error"] for res in results]
        assert len(results[0][epoch]["batches"]) == len(results[1][epoch]["batches"])
        assert sorted(d for res in results for mb in res[epoch]["batches"] for d in mb) == want, epoch
    for res in results:
        assert res[3] == {"batches": [], "error": None}  # an empty pass: nothing, on both ranks
        one = res[4]["error"]  # one document for two replicas: the planner's refusal, on both ranks
        assert res[4]["batches"] == [] and "cannot give each of dp = 2 replicas a micro-batch" in one, one
        err = res[5]["error"]  # rank 1's source fails mid-window in window 1 of epoch 5: the same error on both
        assert err.startswith("StreamSourceError: the stream's source failed on rank 1"), err
        assert "source gone at item 31 (test)" in err
    assert results[0][4]["error"] == results[1][4]["error"]
    before = [d for res in results for mb in res[5]["batches"] for d in mb]
    assert len(before) == len(set(before)) and set(before) <= {r["doc"] for r in PLAN[5]}
    assert len(results[0][5]["batches"]) == len(results[1][5]["batches"]) > 0  # the windows before it were yielded


class LockedRows:
    """Rows of which rank 1 reads some that hold a lock (which pickle refuses) from item 60 on."""

    def __iter__(self):
        for i, row in enumerate(ROWS):
            yield {**row, "handle": threading.Lock()} if i >= 60 and i % 2 == 1 else row


def _unpicklable_rank(rank: int, world: int, out: str) -> None:
    with BalancedStream(LockedRows(), TOPO, COST, window_docs=16, timeout=600) as stream:
        result = _pass(stream, 0)
    Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


def test_an_unpicklable_row_stops_every_rank_at_once(tmp_path):
    run_world(2, _unpicklable_rank, str(tmp_path))
    results = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(2)]
    mine, other = results[1]["error"], results[0]["error"]
    assert mine.startswith("StreamSourceError: rank 1's documents could not be sent: a row for rank 0 cannot be"), mine
    assert "lock" in mine and "\n" not in mine
    assert other.startswith("StreamSourceError: rank 1's documents could not be sent"), other  # no 600 s wait
    assert len(results[0]["batches"]) == len(results[1]["batches"]) > 0
