"""One stream window, end to end: read, gather, plan, exchange (run by the stream's background thread).

Which documents make the window is reading.py's rule (`compose`: the counts gathered, the same decision on every
rank); the window's documents are ordered by (stream, item), so its plan does not depend on which rank read what.

The window is planned by `balancer.plan` (the sampler's planner: static, pipeline or dynamic CP, any overflow
policy) with the seed `window_seed(seed, epoch, index)`; after an elastic resume the resumed window is re-planned
from its segments' history exactly as the sampler re-plans one (`replan_units`).
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import numpy as np

from balancer.planning.window import window_seed
from balancer.streaming.exchange import StreamPeerError, all_gather_records, exchange_rows
from balancer.streaming.reading import Reader, compose
from balancer.streaming.sources import StreamSpec, assign, split_streams
from balancer.training.segments import Segment, plan_units

if TYPE_CHECKING:
    from balancer.planning.cost.model import CostModel
    from balancer.planning.topology import Topology

_NOT_WINDOWED = 0  # window_seed's "windows" argument: never the whole-epoch branch (a stream's length is unknown)


def lengths_digest(lengths: np.ndarray) -> str:
    """A short digest of a window's lengths (a resumed window must re-read the same documents)."""
    return hashlib.sha256(np.asarray(lengths, dtype="<i8").tobytes()).hexdigest()[:16]


@dataclass
class Cursor:
    """Where every stream is, the same on every rank: `pos[v]` items of stream v are in earlier windows, `ended[v]`
    says the stream has nothing after them."""

    specs: list[StreamSpec]
    pos: list[int]
    ended: list[bool]

    def copy(self) -> Cursor:
        return Cursor(list(self.specs), list(self.pos), list(self.ended))


class Meter:
    """Tokens this process holds (read ahead, waiting to be sent, received and not yet yielded), and the peak."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.now += int(n)
            self.peak = max(self.peak, self.now)


class PassMeter:
    """The tokens one pass holds, counted on the stream's `Meter` too; `close()` (the pass is left: set_epoch or a
    new iter() mid-pass) gives what it still holds back, and a window job of it still in flight counts nothing."""

    def __init__(self, meter: Meter) -> None:
        self.meter, self.now, self.closed = meter, 0, False
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            if not self.closed:
                self.now += int(n)
                self.meter.add(n)

    def close(self) -> None:
        with self._lock:
            if not self.closed:
                self.closed = True
                self.meter.add(-self.now)
                self.now = 0


@dataclass
class Window:
    """A planned window as this process sees it."""

    index: int
    start: Cursor  # the streams before this window
    taken: list[int]  # documents of each stream in this window
    after: Cursor  # the streams after it
    lengths: np.ndarray  # [n] in window order
    losses: np.ndarray  # [n] loss tokens per document
    segment: Segment
    history: list  # the segments' history it was planned with (topology, cost, steps), [] when fresh
    ended_after: list  # per stream of `start`: finished after this window
    rows: dict = field(default_factory=dict)  # window-local id -> row, the documents this process trains
    bytes_sent: int = 0

    @property
    def num_docs(self) -> int:
        return len(self.lengths)


def replan_units(
    lengths: np.ndarray, topology: Topology, cost: CostModel, seed: int, overflow: str, history: list
) -> Segment:
    """The window's segment: planned fresh, or (after an elastic resume) the units its `history` segments left,
    re-planned for `topology` and `cost` (the sampler's rule: balancer.training.segments)."""
    if not history:
        return plan_units(None, None, None, topology, cost, seed, overflow, lengths=lengths)
    u_doc = np.arange(len(lengths), dtype=np.int64)
    u_start, u_end = np.zeros(len(lengths), dtype=np.int64), lengths.astype(np.int64)
    for h in history:
        seg = plan_units(u_doc, u_start, u_end, h["topology"], h["cost"], seed, overflow)
        if h["steps"] > seg.num_steps:
            raise ValueError(
                f"the state says {h['steps']} steps of the window were consumed but its plan has {seg.num_steps}"
            )
        left = ~seg.consumed_mask(h["steps"])
        u_doc, u_start, u_end = seg.doc[left], seg.start[left], seg.end[left]
        order = np.lexsort((u_start, u_doc))
        u_doc, u_start, u_end = u_doc[order], u_start[order], u_end[order]
    return plan_units(u_doc, u_start, u_end, topology, cost, seed, overflow)


def receivers(seg: Segment, world: int) -> list[np.ndarray]:
    """For each micro-batch of `seg`, the processes that train it: a replica's (static) or a CP group's (dynamic)
    block of consecutive processes, `world // dp` (`world // pool`) of them."""
    t = seg.topology
    n_mb = len(seg.mb_ptr) - 1
    if t.dynamic:
        per = world // t.pool_size
        group_start, group_size, _ = seg.group_arrays
        return [
            np.arange(int(group_start[k]) * per, (int(group_start[k]) + int(group_size[k])) * per) for k in range(n_mb)
        ]
    per = world // t.dp
    replica = [(k % t.bins_per_step) // seg.step_micro_batches(k // t.bins_per_step) for k in range(n_mb)]
    return [np.arange(r * per, (r + 1) * per) for r in replica]


def resplit_cursor(cur: Cursor, world: int) -> Cursor:
    """`cur` with its streams' remainders re-cut for `world` ranks when it has fewer streams (`split_streams`)."""
    if len(cur.specs) >= world:
        return cur
    ended = []
    for v in range(len(cur.specs)):
        m = world // len(cur.specs) + (v < world % len(cur.specs))
        ended += [cur.ended[v]] * m
    specs, pos = split_streams(cur.specs, cur.pos, world)
    return Cursor(specs, pos, ended)


class Pipeline:
    """Prepares windows one after the other for one pass over the stream (`prepare`); owned by one thread."""

    def __init__(self, stream, cursor: Cursor, forced=None, history=(), resplit=None) -> None:
        self.stream = stream
        self.cursor = cursor
        # the resumed window as the state recorded it: (documents per stream, streams finished after it, digest)
        self.forced = None if forced is None else forced[0]
        self._forced_after = None if forced is None else forced[1]
        self._forced_digest = None if forced is None else forced[2]
        self.history = list(history)
        self.resplit = resplit  # (world) the streams are re-cut for after the resumed window
        self.meter = PassMeter(stream.meter)  # this pass's tokens (given back when the pass is left)
        self.reader = Reader(stream.source, self.meter)

    def prepare(self, index: int) -> Optional[Window]:
        """Window `index` (the next one): read, gather, plan, exchange; None at the end of the stream. A collective
        that fails (another process died, stalled past the stream's timeout, or stopped before this window) raises
        a StreamPeerError naming the window and the timeout."""
        try:
            return self._prepare(index)
        except StreamPeerError as e:
            raise StreamPeerError(
                f"BalancedStream window {index}: {e}: a process of the stream's group died, did not reach this "
                f"window within timeout={self.stream.timeout:g} s, or stopped reading before it; this rank's "
                "micro-batches stop here (none of this window was yielded)"
            ) from e.__cause__

    def _prepare(self, index: int) -> Optional[Window]:
        s = self.stream
        cur = self.cursor
        if all(cur.ended) and self.forced is None:
            return None
        topology, cost = s.model_for(index)
        mine = assign(len(cur.specs), s.world)
        gather = lambda record: all_gather_records(record, s.group, s.world)  # noqa: E731
        comp = compose(self.reader, cur, mine, s.grank, s.window_docs, topology.bins_per_step, self.forced, gather)
        if self.forced is not None:
            self._check_forced(comp, cur, index)
            assert self._forced_after is not None, "a forced window comes with the state after it"
            comp.ended = [bool(e) for e in self._forced_after]
            self.forced = self._forced_after = self._forced_digest = None
        after = Cursor(list(cur.specs), [p + t for p, t in zip(cur.pos, comp.taken)], list(comp.ended))
        history, self.history = self.history, []
        ended_after = list(after.ended)
        if self.resplit is not None:
            after = self._resplit(after)
            self.reader.close_except(after.specs)
        self.cursor = after
        if len(comp.lengths) == 0:
            return None
        seed = window_seed(s.seed, s.epoch, index, _NOT_WINDOWED)
        try:
            seg = replan_units(comp.lengths, topology, cost, seed, s.overflow, history)
        except ValueError as e:
            raise ValueError(f"window {index} of the stream ({len(comp.lengths)} documents): {e}") from None
        win = Window(index, cur.copy(), comp.taken, after.copy(), comp.lengths, comp.losses, seg, history, ended_after)
        self._exchange(win, comp.rows, (comp.owner_rank, comp.owner_local))
        return win

    def _check_forced(self, comp, cur: Cursor, index: int) -> None:
        assert self.forced is not None, "called for a forced window"
        for v, (got, want) in enumerate(zip(comp.taken, self.forced)):
            if got != want:
                raise ValueError(
                    f"resuming window {index}: stream {v} ({cur.specs[v]}) now has {got} items from item "
                    f"{cur.pos[v]} on, the state recorded {want}: the source changed"
                )
        if self._forced_digest is not None and lengths_digest(comp.lengths) != self._forced_digest:
            raise ValueError(
                f"resuming window {index}: its documents' lengths differ from those the state recorded: the source "
                "changed"
            )

    def _resplit(self, after: Cursor) -> Cursor:
        world, self.resplit = self.resplit, None
        return resplit_cursor(after, world)

    def _exchange(self, win: Window, rows: list, owner) -> None:
        """Send every document this process read to the processes that train it; keep what this one trains."""
        s = self.stream
        owner_rank, owner_local = owner
        seg = win.segment
        recv = receivers(seg, s.world)
        need: list[set] = [set() for _ in range(s.world)]
        mb_of_entry = np.repeat(np.arange(len(seg.mb_ptr) - 1), np.diff(seg.mb_ptr))
        for d, k in zip(seg.doc.tolist(), mb_of_entry.tolist()):
            if owner_rank[d] == s.grank:
                for p in recv[k].tolist():
                    need[p].add(d)
        outgoing = [[(d, rows[int(owner_local[d])]) for d in sorted(need[p])] for p in range(s.world)]
        got, sent = exchange_rows(outgoing, s.group, s.world, s.grank)
        win.rows = dict(got)
        win.bytes_sent = sent
        held = sum(len(r["input_ids"]) for r in win.rows.values())
        kept_own = sum(len(r["input_ids"]) for d, r in outgoing[s.grank])
        read = sum(len(r["input_ids"]) for r in rows)
        self.meter.add(held - kept_own)  # received from others: held alongside what was read until it is dropped
        self.meter.add(-(read - kept_own))
