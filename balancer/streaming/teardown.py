"""Tearing a BalancedStream's background work down: its thread and its own process group.

The stream's thread runs the window jobs (read, gather, plan, exchange) in order, and its collectives run on the
stream's own gloo group. A process must never end while that thread is inside a collective: the interpreter would
tear gloo down under it and the process dies with SIGABRT ("terminate called without an active exception").
Every rank hands its thread the same jobs at the same micro-batch (the next window's job starts half-way through
the current one on every rank), so a job in flight finishes on every rank once each rank lets it.

`Teardown.run()` (what `BalancedStream.close()`, `with BalancedStream(...)`, garbage collection, interpreter exit
and `torch.distributed.destroy_process_group()` all call, once: a stream built in a distributed world wraps that
function so that it closes the open streams before destroying every group) asks the thread to stop after the job
submitted last (run even when the thread had not picked it up yet: the other ranks' collectives wait for it), waits
for it (up to the stream's `close_timeout`, `CLOSE_TIMEOUT` seconds by default), and then releases the
stream's group. A thread still inside a collective after that (a rank that stopped without ever reaching the job:
the collective waits for it until the group's `timeout`, the stream's, then fails) is left alone with one warning
naming it: destroying the group under it would abort the process.
"""

from __future__ import annotations

import logging
import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

log = logging.getLogger(__name__)

CLOSE_TIMEOUT = 300.0  # seconds close() waits for a window job in flight (it reads, gathers, plans and exchanges)
_STOP = object()


class StreamClosed(RuntimeError):
    """The stream was closed: it yields nothing more."""


class Worker:
    """One daemon thread running submitted calls in order: the only thread that uses the stream's process group."""

    def __init__(self) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="balancer-stream", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        if self._stopping:
            raise StreamClosed("the BalancedStream is closed: build a new one to read the stream again")
        fut: Future = Future()
        self._jobs.put((fut, fn, args))
        return fut

    def stop(self, timeout: float) -> bool:
        """Stop after the jobs submitted so far, also one the thread has not picked up yet (every rank submitted it at
        the same micro-batch, and the others' collectives wait for this rank's); refuse new ones. True when the
        thread has ended within `timeout` seconds."""
        self._stopping = True
        self._jobs.put(_STOP)
        if threading.current_thread() is self._thread:  # collected on its own thread: it ends after this job
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                break
            fut, fn, args = job
            if not fut.set_running_or_notify_cancel():  # cancelled by its caller: never started
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # handed to the main thread by fut.result()
                fut.set_exception(e)
            del job, fut, fn, args  # an idle thread holds no job: a dropped stream can be collected
        while not self._jobs.empty():  # nothing is queued behind the stop (submit refuses then); kept as a guard
            job = self._jobs.get_nowait()
            if job is not _STOP:
                job[0].cancel()


_OPEN: weakref.WeakSet = weakref.WeakSet()  # the Teardowns of streams not yet closed, in this process


def close_open_streams() -> None:
    """Close every stream of this process that is still open (their jobs in flight finish first)."""
    for teardown in list(_OPEN):
        teardown.close()


def _closing_first(destroy):
    """`torch.distributed.destroy_process_group` that first closes the open streams: destroying every group while a
    stream's thread is inside a collective on its own group aborts the process (the early-stop world's SIGABRT)."""

    def destroy_process_group(group=None):
        if group is None:
            close_open_streams()
        return destroy(group)

    destroy_process_group.__wrapped__ = destroy  # type: ignore[attr-defined]  # a function takes attributes
    destroy_process_group.__doc__ = destroy.__doc__
    return destroy_process_group


def guard_destroy() -> None:
    """Install `_closing_first` on `torch.distributed.destroy_process_group` (once per process)."""
    import torch.distributed as dist

    if not hasattr(dist.destroy_process_group, "__wrapped__"):
        dist.destroy_process_group = _closing_first(dist.destroy_process_group)


class Teardown:
    """The stream's thread (started on first use) and process group, released once (module docstring). Holds no
    reference to the stream, so that a stream dropped without `close()` is still collected (and torn down)."""

    def __init__(self, owner, group, close_timeout: float = CLOSE_TIMEOUT) -> None:
        self.group = group
        self.close_timeout = close_timeout  # seconds run() waits for a job in flight (BalancedStream's close_timeout)
        self.worker: Worker | None = None
        self.closed = False
        self._finalizer = weakref.finalize(owner, self.run)  # also runs at interpreter exit
        _OPEN.add(self)
        if group is not None:
            guard_destroy()

    def check_open(self) -> None:
        """A StreamClosed error once the stream was closed."""
        if self.closed:
            raise StreamClosed("the BalancedStream is closed: build a new one to read the stream again")

    def start_worker(self) -> Worker:
        self.check_open()
        if self.worker is None:
            self.worker = Worker()
        return self.worker

    def close(self, timeout: float | None = None) -> None:
        """`run` (at most once, whoever calls first), waiting `timeout` seconds (default `close_timeout`)."""
        if timeout is not None:
            self.close_timeout = timeout
        self._finalizer()

    def run(self) -> None:
        self.closed = True
        _OPEN.discard(self)
        worker, self.worker = self.worker, None
        if worker is not None and not worker.stop(self.close_timeout):
            log.warning(
                "BalancedStream.close: the stream's thread is still inside a window's collective after %g s "
                "(close_timeout; another rank stopped before reaching that window, and the collective waits up to the "
                "stream's timeout); its process group is left as it is",
                self.close_timeout,
            )
            return
        release_group(self.group)
        self.group = None


def release_group(group: Any) -> None:
    """Destroy the stream's own gloo group where torch.distributed still holds it (a no-op after the user's
    `destroy_process_group()`, which destroyed every group)."""
    if group is None:
        return
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        dist.destroy_process_group(group)
    except (ValueError, RuntimeError) as e:  # already destroyed: nothing left to release
        log.debug("BalancedStream.close: the stream's group was already released (%s)", e)
