"""BalancedStream: this rank's balanced micro-batches from a stream of tokenized documents (docs/streaming.md).

    stream = BalancedStream(hf_streaming_dataset, topo, cost, window_docs=8192, seed=0)
    loader = DataLoader(stream, batch_size=None, collate_fn=PackedCollator(cp_rank=c, cp_size=topo.cp))

Every rank reads its own streams of the source (balancer.streaming.sources), and per window (windows.py) the
ranks gather the lengths and loss-token counts of what they read (one all-gather), plan the window with the
sampler's planner, and send every document to the processes that train it (two all-to-alls). All of it runs on one
background thread that owns a gloo process group of its own, created when the stream is built (so the stream's
collectives never interleave with the training loop's on the default group); the next window is read, gathered,
planned and exchanged while the current one trains (it starts half-way through the current window, at the same
micro-batch on every rank). The main thread never communicates: `state_dict()` is built from what the gathers
already shared, the same on every rank.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Optional

import numpy as np
import torch

from balancer.planning.cost.model import CostModel
from balancer.planning.schedule import WindowSchedule, check_seed, resume_chain, segments_state
from balancer.planning.topology import Topology
from balancer.planning.units import OVERFLOW_POLICIES, check_topology_and_cost
from balancer.planning.window import check_window_docs
from balancer.streaming import state as state_mod
from balancer.streaming.exchange import checked_seconds, pool_rank, stream_group
from balancer.streaming.sources import StreamSpec, initial_streams, open_source
from balancer.streaming.teardown import CLOSE_TIMEOUT, Teardown
from balancer.streaming.windows import Cursor, Meter, Pipeline, Window, lengths_digest, resplit_cursor
from balancer.training.indices import CPGroup

log = logging.getLogger(__name__)

KEEP_PLANS = 4  # windows whose plans a pass keeps (a monitor closes a step up to a window after the loader read it)
WORKERS_REFUSED = (
    "BalancedStream runs in the training process: use DataLoader(..., num_workers=0) (its reading, planning and "
    "document exchange already run on a background thread there)"
)


class BalancedStream(torch.utils.data.IterableDataset):
    """This rank's balanced micro-batches (lists of rows) of a stream of documents (module docstring).

    Args:
        source: a Hugging Face streaming `datasets.IterableDataset`, a pretokenized folder (path), or any
            re-iterable iterable of rows (dicts with `input_ids`; other columns are carried through untouched) or
            token-id sequences (yielded as `{"input_ids": ...}`).
        topology, cost: the `Topology` and `CostModel` the windows are planned for.
        window_docs: documents per window (at least dp * micro_batches); more balances better and buffers more.
        dp_rank, rank: this rank's DP index / pool rank `dp_rank * cp + cp_rank` (checked against the process group:
            the group's processes are the replicas in order, `world // dp` consecutive ones each; with dynamic CP the
            pool ranks in order, `world // (dp * cp)` consecutive ones each).
        group: the process group whose processes share the stream (default: the whole world); the stream creates
            a gloo group over the same processes for its thread (collective over the default group: build the
            stream on every process, in the same order). Without torch.distributed: one process, `dp*cp == 1`.
        seed: windows are planned with seeds drawn from (seed, epoch, window).
        overflow: the planner's policy for documents over `max_tokens * cp` ("error", "split", "truncate").
        timeout: seconds a window's collective (on the stream's own group) waits for the other processes: a process
            that died or stalled makes the others raise `StreamPeerError` naming the window (default 1800, torch's
            default for a gloo group).
        close_timeout: seconds `close()` (and teardown on garbage collection or at exit) waits for the window job
            in flight before leaving the thread with a warning (default 300).
    """

    def __init__(
        self,
        source,
        topology: Topology,
        cost: CostModel,
        *,
        window_docs: int,
        dp_rank: Optional[int] = None,
        rank: Optional[int] = None,
        group=None,
        seed: int = 0,
        overflow: str = "error",
        timeout: float = 1800.0,
        close_timeout: float = CLOSE_TIMEOUT,
    ) -> None:
        super().__init__()
        check_topology_and_cost(topology, cost)
        self.window_docs = check_window_docs(window_docs, topology)
        if overflow not in OVERFLOW_POLICIES:
            raise ValueError(f"overflow must be one of {OVERFLOW_POLICIES}, got {overflow!r}")
        seed = check_seed(seed)
        self.timeout = checked_seconds("timeout", timeout)
        close_timeout = checked_seconds("close_timeout", close_timeout)
        self.source = open_source(source)
        self.topology, self.cost, self.seed, self.overflow = topology, cost, seed, overflow
        self.group, self.world, self.grank = stream_group(group, self.timeout)
        self.pool_rank = pool_rank(topology, self.world, self.grank, dp_rank, rank)
        self.dp_rank = self.pool_rank // topology.cp
        self.epoch = 0
        self.meter = Meter()
        self.bytes_sent = 0
        self.windows_done = 0
        self.schedule = WindowSchedule(topology, cost)  # which model plans each window of this pass
        self._submitted = -1  # the highest window handed to the thread
        self._pass_changes = 0  # schedule.changes[this:] are this pass's (a pass before may have had later ones)
        self._setup: Optional[dict] = None  # a loaded state waiting for the next iter()
        self._iter: Optional[_StreamIter] = None
        self._teardown = Teardown(self, self.group, close_timeout)  # close(), with, GC and exit: thread, group released
        self.monitor = None  # a balancer.BalanceMonitor on StreamSteps(self) (balancer.measured.streams)

    def __getstate__(self) -> dict:  # a DataLoader worker gets a copy that refuses to iterate
        state = dict(self.__dict__)
        state.update(group=None, _teardown=None, _iter=None, meter=None)
        return state

    # ---- models ---------------------------------------------------------------------------------------------
    def update_model(
        self, cost: CostModel, rank_speeds: Optional[Sequence[float]] = None, first_window: int = 0
    ) -> None:
        """Plan windows `first_window`.. with `cost` (and `rank_speeds`, one positive float per DP replica, where
        the Topology supports them). Call it on every rank at the same micro-batch; `first_window` must not have
        been handed to the planning thread yet (`next_unplanned_window`). The windows' step counts do not depend
        on it (the planner's contract). A pass of another epoch (`set_epoch`) plans all its windows with the latest
        model."""
        check_topology_and_cost(self.topology, cost)
        if isinstance(first_window, bool) or not isinstance(first_window, (int, np.integer)) or first_window < 0:
            raise ValueError(f"first_window must be a non-negative integer, got {first_window!r}")
        changes = self.schedule.changes[self._pass_changes :]  # a new pass of the same epoch starts over
        if first_window < self.next_unplanned_window:
            raise ValueError(
                f"first_window={first_window}: windows up to {self.next_unplanned_window - 1} are already planned "
                f"or being planned; the first a new model can reach is {self.next_unplanned_window}"
            )
        if changes and first_window < changes[-1].window:
            raise ValueError(f"first_window={first_window} is before an earlier update's ({changes[-1].window})")
        self.schedule.update(cost, rank_speeds, first_window, epoch=self.epoch)

    @property
    def next_unplanned_window(self) -> int:
        return self._submitted + 1

    def model_for(self, window: int) -> tuple[Topology, CostModel]:
        """(topology, cost model) window `window` of this pass is planned with."""
        return self.schedule.model(self.epoch, window)

    @property
    def position(self) -> int:
        """Micro-batches of this pass so far (a loaded state's, before iterating), in whole steps before the current
        window's segment plus those of it."""
        if self._setup is not None or self._iter is None:
            setup = self._setup or self._fresh_setup()
            return setup["step"] * self.topology.micro_batches + setup["position"]
        return self._iter.position()

    @property
    def window_plans(self) -> dict:
        """The last windows of this pass entered (at most KEEP_PLANS): window -> (its first step in the pass, its
        plan segment); read-only."""
        return {} if self._iter is None else self._iter.plans

    # ---- iteration ------------------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch: the next `iter()` replays the source from its start (windows planned with seeds of
        (seed, epoch)), unless a state of this epoch was loaded. Forwarded to the source where it has
        `set_epoch` (a seeded `datasets` shuffle buffer reshuffles per epoch)."""
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative integer, got {epoch!r}")
        if int(epoch) != self.epoch:  # a new pass: every window of it is planned with the latest model
            if self._iter is not None:  # the old pass's iterator ends: its windows would take the new epoch's seeds
                self._iter.stale = f"set_epoch({int(epoch)}) was called while this pass (epoch {self.epoch}) was read"
                self._iter.pipeline.meter.close()  # its buffered rows are no longer held for this stream
            # no iterator of the new pass yet: its state is the pass's start (the old one's end lost the new pass)
            self._setup, self._submitted, self._iter = None, -1, None
            self.schedule.new_pass(int(epoch))
        self.epoch = int(epoch)
        self.source.set_epoch(self.epoch)

    def _fresh_setup(self) -> dict:
        specs = initial_streams(self.source.num_parts, self.world)
        cursor = Cursor(specs, [0] * len(specs), [False] * len(specs))
        return {"window": 0, "cursor": cursor, "forced": None, "history": [], "position": 0, "resplit": None, "step": 0}

    def __iter__(self) -> _StreamIter:
        if torch.utils.data.get_worker_info() is not None or self.meter is None:
            raise RuntimeError(WORKERS_REFUSED)
        self._teardown.start_worker()  # refuses a closed stream
        if self._setup is None:  # a fresh pass (a second train() reads the epoch again): its own changes from here
            self._pass_changes = len(self.schedule.changes)
        setup, self._setup = self._setup or self._fresh_setup(), None
        self._submitted = setup["window"] - 1  # a new pass: nothing of it handed to the thread yet
        if self._iter is not None:  # the pass before is left: its buffered rows are no longer held for this stream
            self._iter.pipeline.meter.close()
        self._iter = _StreamIter(self, setup)
        return self._iter

    def _submit(self, pipeline: Pipeline, index: int) -> Future:
        worker = self._teardown.start_worker()  # refuses after close()
        self._submitted = max(self._submitted, index)
        return worker.submit(pipeline.prepare, index)

    def close(self, timeout: Optional[float] = None) -> None:
        """Stop the background thread (after the window job in flight, which every rank runs) and release the
        stream's process group (balancer.streaming.teardown); the stream yields nothing more. Waits at most
        `timeout` seconds (default: the stream's `close_timeout`) for that job: a job still inside a collective then
        (another rank never reached that window) is left with one warning. Idempotent; also run by
        `with BalancedStream(...) as stream:`, on garbage collection and at interpreter exit."""
        wait = None if timeout is None else checked_seconds("timeout", timeout)
        if self._teardown is not None:
            self._teardown.close(wait)

    @property
    def closed(self) -> bool:
        """Whether `close()` ran (the stream yields nothing more)."""
        return self._teardown is not None and self._teardown.closed

    def __enter__(self) -> BalancedStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def step_loss_tokens(self) -> int:
        """Global loss tokens (all replicas) of the step of the micro-batch yielded last: the normaliser of
        `balancer.loss.token_loss`, from the gathered per-document counts (no communication)."""
        if self._iter is None:
            raise ValueError("no micro-batch of this stream has been yielded yet")
        return self._iter.step_loss_tokens()

    def stats(self) -> dict:
        """This process's figures so far: bytes it sent to other processes, its peak of buffered tokens (read ahead,
        waiting to be sent, received and not yet yielded), and the windows it finished."""
        return {"bytes_sent": self.bytes_sent, "peak_buffered_tokens": self.meter.peak, "windows": self.windows_done}

    # ---- state ----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The resume state after the micro-batches yielded so far (module docstring of balancer.streaming.state);
        no communication, the same on every rank (an attached monitor's part, "monitor", but for its CPU times and
        the refit records the first rank keeps)."""
        if self._setup is not None or self._iter is None:
            state = self._setup_state(self._setup or self._fresh_setup())
        else:
            state = self._iter.state_dict()
        if self.monitor is not None:
            state["monitor"] = self.monitor.state_dict()
        return state

    def _setup_state(self, setup: dict) -> dict:
        cur, forced = setup["cursor"], setup["forced"]
        topology, cost = self.model_for(setup["window"])
        segments = [*setup["history"], {"topology": topology, "cost": cost, "steps": None}]
        return self._state(setup["window"], cur, forced, setup["position"], segments, setup["step"])

    def _state(self, window: int, cur: Cursor, forced, position: int, segments: list, step: int) -> dict:
        taken, ended_after, digest = (None, None, None) if forced is None else forced
        return {
            **state_mod.header(),
            "epoch": self.epoch,
            "seed": self.seed,
            "overflow": self.overflow,
            "window_docs": self.window_docs,
            "source": self.source.fingerprint,
            "window": int(window),
            "streams": [[s.part, s.stride, s.offset, int(p), int(e)] for s, p, e in zip(cur.specs, cur.pos, cur.ended)],
            "taken": None if taken is None else [int(x) for x in taken],
            "ended_after": None if ended_after is None else [int(bool(x)) for x in ended_after],
            "digest": digest,
            "position": int(position),
            "step": int(step),
            "segments": segments_state(segments),
            "models": self.schedule.changes_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume from `state_dict()` output, also on another DP size or topology (at a step boundary then): the
        next `iter()` yields the rest of the saved epoch, every remaining document exactly once. A state of another
        seed, overflow policy, window size or source is refused naming what differs."""
        st = state_mod.check_state(state)
        state_mod.check_match(st, self)
        self.schedule.load_changes(st["models"], st["epoch"], state_mod.WHERE)
        self._pass_changes = len(self.schedule.changes)
        specs = [StreamSpec(p, s, o) for p, s, o, _, _ in st["streams"]]
        cursor = Cursor(specs, [r[3] for r in st["streams"]], [bool(r[4]) for r in st["streams"]])
        window, position, step = st["window"], st["position"], st.get("step", 0)
        mine = self.schedule.model(st["epoch"], window)
        history, position, consumed = resume_chain(st["segments"], position, mine, window)
        step += consumed
        forced = None if st["taken"] is None else (st["taken"], st["ended_after"], st["digest"])
        resplit = self.world if len(specs) < self.world else None
        if forced is None and resplit is not None:
            cursor, resplit = resplit_cursor(cursor, resplit), None
        self.epoch = st["epoch"]
        self.source.set_epoch(self.epoch)
        self._setup = {
            "window": window, "cursor": cursor, "forced": forced, "history": history, "position": position,
            "resplit": resplit, "step": step,
        }  # fmt: skip
        self._submitted = window - 1
        if self.monitor is not None:  # as the sampler: the monitor's state, then its step count from here
            if "monitor" in state:
                self.monitor.load_state_dict(state["monitor"])
            self.monitor.on_sampler_load()


class _StreamIter:
    """One pass over the stream (from a resume point); Stateful (torchdata) through its stream."""

    def __init__(self, stream: BalancedStream, setup: dict) -> None:
        self.stream = stream
        self.setup = setup
        self.pipeline = Pipeline(stream, setup["cursor"], setup["forced"], setup["history"], setup["resplit"])
        self.index = setup["window"]
        self.win: Optional[Window] = None
        self.future: Optional[Future] = None
        self.done = False
        self.skip = setup["position"]
        self.first_step = setup["step"]  # this pass's steps before the current window's segment
        self.plans: dict[int, tuple[int, object]] = {}  # the last windows entered: index -> (first step, segment)
        self.stale: Optional[str] = None  # why this pass was ended by set_epoch (set by the stream)

    def __iter__(self) -> _StreamIter:
        return self

    def __next__(self) -> list:
        s = self.stream
        s._teardown.check_open()  # a closed stream yields nothing more
        if self.stale is not None:
            raise RuntimeError(f"BalancedStream: {self.stale}: this iterator is over; iterate the stream again")
        while True:
            if self.win is None:
                if self.done:
                    raise StopIteration
                if self.future is None:
                    self.future = s._submit(self.pipeline, self.index)
                win, self.future = self.future.result(), None
                if win is None:
                    self.done = True
                    raise StopIteration
                self._enter(win)
            if self.local < len(self.ks):
                break
            self._leave()
        if 2 * self.local >= len(self.ks) and self.future is None:
            self.future = s._submit(self.pipeline, self.index + 1)
        items = self._items(self.local)
        for d in self.release.get(self.local, ()):
            row = self._current().rows.pop(d)
            self.pipeline.meter.add(-len(row["input_ids"]))
        self.local += 1
        return items

    def _enter(self, win: Window) -> None:
        s, t = self.stream, win.segment.topology
        r = s.pool_rank if t.dynamic else s.dp_rank
        seg = win.segment
        steps = range(seg.num_steps)  # a short last step (M' < M) has its own count
        self.ks = [seg.mb_index(step, r, m) for step in steps for m in range(seg.step_micro_batches(step))]
        last: dict[int, int] = {}
        for j, k in enumerate(self.ks):
            for d in seg.placements(k)[0].tolist():
                last[d] = j
        self.release: dict[int, list] = {}
        for d, j in last.items():
            self.release.setdefault(j, []).append(d)
        self.win, self.local, self.skip = win, self.skip, 0
        self.plans[win.index] = (self.first_step, seg)
        self.plans.pop(win.index - KEEP_PLANS, None)
        if self.local > len(self.ks):
            raise ValueError(
                f"the state's position {self.local} is past window {win.index}'s {len(self.ks)} micro-batches"
            )
        for j in range(self.local):  # a resumed window: what was consumed before is dropped
            for d in self.release.get(j, ()):
                self.pipeline.meter.add(-len(win.rows.pop(d)["input_ids"]))
        s.bytes_sent += win.bytes_sent

    def _current(self) -> Window:
        """The window being read (between `_enter` and `_leave`)."""
        assert self.win is not None, "a window is entered before its micro-batches are read"
        return self.win

    def _leave(self) -> None:
        s = self.stream
        for row in self._current().rows.values():  # documents of other ranks' micro-batches never stay (none expected)
            self.pipeline.meter.add(-len(row["input_ids"]))
        s.windows_done += 1
        self.first_step += self._current().segment.num_steps
        self.win, self.index = None, self.index + 1

    def _items(self, j: int) -> list:
        win = self._current()
        seg = win.segment
        k = self.ks[j]
        doc, start, end = seg.placements(k)
        group = None
        if seg.topology.dynamic:
            group = seg.group(k, self.stream.pool_rank)
        out = []
        for d, a, b in zip(doc.tolist(), start.tolist(), end.tolist()):
            row = win.rows[d]
            if a == 0 and b == int(win.lengths[d]) and group is None:
                out.append(row)
                continue
            item = dict(row)
            if not (a == 0 and b == int(win.lengths[d])):
                for key in ("input_ids", "labels"):
                    if item.get(key) is not None:
                        item[key] = item[key][a:b]
            if group is not None:
                item["cp_group"] = CPGroup(*group)
            out.append(item)
        return out

    def step_loss_tokens(self) -> int:
        """Global loss tokens of the step of the micro-batch yielded last (all replicas): the gathered per-document
        counts (a part of a split document: its tokens less one, exact when the document has no masked labels)."""
        if self.win is None or self.local == 0:
            raise ValueError("no micro-batch of this pass has been yielded yet")
        seg, win = self.win.segment, self.win
        step = (self.local - 1) // seg.topology.micro_batches
        sl = seg.step_slice(step)
        total = 0
        for d, a, b in zip(seg.doc[sl].tolist(), seg.start[sl].tolist(), seg.end[sl].tolist()):
            n = int(win.lengths[d])
            if a == 0 and b == n:
                total += int(win.losses[d])
            elif int(win.losses[d]) == n - 1:
                total += b - a - 1
            else:
                raise ValueError(
                    "the step holds part of a document with masked labels: its loss tokens are not known from the "
                    "gathered counts; all-reduce the collator's num_loss_tokens over the step instead"
                )
        return total

    def state_dict(self) -> dict:
        s = self.stream
        if self.win is None:
            if not self.done:  # not started
                return s._setup_state(self.setup)
            topology, cost = s.model_for(self.index)
            segments = [{"topology": topology, "cost": cost, "steps": None}]
            return s._state(self.index, self.pipeline.cursor, None, 0, segments, self.first_step)
        win = self.win
        if self.local >= len(self.ks):  # the window is done: the state of the next one, not read yet
            topology, cost = s.model_for(win.index + 1)
            segments = [{"topology": topology, "cost": cost, "steps": None}]
            return s._state(win.index + 1, win.after, None, 0, segments, self.first_step + win.segment.num_steps)
        forced = (win.taken, win.ended_after, lengths_digest(win.lengths))
        segments = [*win.history, {"topology": win.segment.topology, "cost": win.segment.cost, "steps": None}]
        return s._state(win.index, win.start, forced, self.local, segments, self.first_step)

    def position(self) -> int:
        """Micro-batches of this pass so far, counted as whole steps before the window's segment plus those of it
        (a window finished: all its steps, a short last one as a whole step)."""
        m = self.stream.topology.micro_batches
        if self.win is None:
            return self.first_step * m
        if self.local >= len(self.ks):
            return (self.first_step + self.win.segment.num_steps) * m
        return self.first_step * m + self.local

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state)
        fresh = self.stream.__iter__()
        self.__dict__.update(fresh.__dict__)
        self.stream._iter = self
