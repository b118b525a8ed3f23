"""The stream's background thread (balancer.streaming.teardown.Worker) runs every job submitted before `stop`, also one
it has not picked up yet: every rank submits a window's job at the same micro-batch and the other ranks' collectives
wait for this rank's (old: such a job was cancelled, and the others waited their whole close timeout)."""

from __future__ import annotations

import threading

import pytest

from balancer.streaming.teardown import StreamClosed, Worker


def test_a_job_submitted_before_stop_runs_even_if_not_started():
    release, ran = threading.Event(), []
    worker = Worker()
    busy = worker.submit(release.wait, 30)  # the thread is busy: the next job waits in the queue
    queued = worker.submit(ran.append, "window job")
    assert worker.stop(0.05) is False  # asked to stop while busy: the queued job is not dropped
    with pytest.raises(StreamClosed):  # nothing new after stop
        worker.submit(ran.append, "after stop")
    release.set()
    assert worker.stop(30) is True
    assert busy.result(0) is True and queued.result(0) is None
    assert ran == ["window job"]  # old: cancelled, never run


def test_stop_returns_false_while_a_job_is_still_running():
    release = threading.Event()
    worker = Worker()
    worker.submit(release.wait, 30)
    assert worker.stop(0.2) is False  # the caller warns and leaves the thread (BalancedStream.close)
    release.set()
    assert worker.stop(30) is True
