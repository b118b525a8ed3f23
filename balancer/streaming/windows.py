"""One stream window, end to end: read, gather, plan, exchange (run by the stream's background thread).

Window composition (the same on every rank, from what earlier windows shared): the streams not known to be
finished split `window_docs` between them (`quotas`); each reading rank reads, from each of its streams, up to the
stream's quota plus `reserve` more items (`reserve` = dp * micro_batches, the documents one step needs). A stream
that had them all gives its quota to the window and keeps the rest for the next; a stream that ran out gives
everything it had and is finished. So a window is never the last one unless every stream is finished, and the
window after a full one holds at least `reserve` documents: the last window can always fill a step (no padding,
nothing dropped), also when one rank's streams end early. The window's documents are ordered by (stream, item), so
its order, and so its plan, do not depend on which rank read what.

The window is planned by `balancer.plan` (the sampler's planner: static, pipeline or dynamic CP, any overflow
policy) with the seed `window_seed(seed, epoch, index)`; after an elastic resume the resumed window is re-planned
from its segments' history exactly as the sampler re-plans one (`replan_units`).
"""

from __future__ import annotations

import collections
import hashlib
import threading
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from balancer.planning.window import window_seed
from balancer.streaming.exchange import (
    StreamSourceError,
    all_gather_records,
    decode_record,
    encode_record,
    exchange_rows,
    record_size,
)
from balancer.streaming.sources import Source, StreamSpec, assign, loss_tokens, split_streams
from balancer.training.segments import Segment, plan_units

_NOT_WINDOWED = 0  # window_seed's "windows" argument: never the whole-epoch branch (a stream's length is unknown)


def lengths_digest(lengths: np.ndarray) -> str:
    """A short digest of a window's lengths (a resumed window must re-read the same documents)."""
    return hashlib.sha256(np.asarray(lengths, dtype="<i8").tobytes()).hexdigest()[:16]


def quotas(ended: list[bool], window_docs: int) -> np.ndarray:
    """Documents each stream gives a window: `window_docs` split over the unfinished streams (earlier ones +1)."""
    live = [v for v, e in enumerate(ended) if not e]
    out = np.zeros(len(ended), dtype=np.int64)
    if live:
        base, extra = divmod(int(window_docs), len(live))
        for i, v in enumerate(live):
            out[v] = base + (i < extra)
    return out


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


class Reader:
    """This process's open streams: an iterator and the items read ahead of the window they belong to."""

    def __init__(self, source: Source, meter: Meter) -> None:
        self.source, self.meter = source, meter
        self._open: dict[StreamSpec, tuple] = {}

    def take(self, spec: StreamSpec, pos: int, quota: int, reserve: int, forced: Optional[int]):
        """(rows, ended): the items of stream `spec` for a window starting at its item `pos` (module docstring);
        `forced`: exactly that many (a resumed window, whose counts the state recorded)."""
        it, buf, at = self._open.get(spec, (None, None, None))
        if it is None or at != pos:
            it, buf = self.source.read(spec, pos), collections.deque()
        want = forced if forced is not None else quota + reserve
        ended = False
        while len(buf) < want:
            try:
                row = next(it)
            except StopIteration:
                ended = True
                break
            buf.append(row)
            self.meter.add(len(row["input_ids"]))
        n = min(len(buf), forced if forced is not None else (len(buf) if ended else quota))
        rows = [buf.popleft() for _ in range(n)]
        self._open[spec] = (it, buf, pos + n)
        return rows, ended

    def close_except(self, specs) -> None:
        keep = set(specs)
        for spec in list(self._open):
            if spec not in keep:
                _, buf, _ = self._open.pop(spec)
                self.meter.add(-sum(len(r["input_ids"]) for r in buf))


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


def replan_units(lengths: np.ndarray, topology, cost, seed: int, overflow: str, history: list) -> Segment:
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
        return [
            np.arange(int(seg.group_start[k]) * per, (int(seg.group_start[k]) + int(seg.group_size[k])) * per)
            for k in range(n_mb)
        ]
    per = world // t.dp
    return [
        np.arange(
            ((k % t.bins_per_step) // t.micro_batches) * per, ((k % t.bins_per_step) // t.micro_batches + 1) * per
        )
        for k in range(n_mb)
    ]


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
        self.reader = Reader(stream.source, stream.meter)

    def prepare(self, index: int) -> Optional[Window]:
        """Window `index` (the next one): read, gather, plan, exchange; None at the end of the stream."""
        s = self.stream
        cur = self.cursor
        if all(cur.ended) and self.forced is None:
            return None
        topology, cost = s.model_for(index)
        q = quotas(cur.ended, s.window_docs)
        reserve = topology.bins_per_step
        mine = assign(len(cur.specs), s.world)
        error, rows, counts, ended = self._read(mine[s.grank], cur, q, reserve)
        docs_max = max(
            sum(int(self.forced[v]) if self.forced is not None else int(q[v]) + reserve for v in m if not cur.ended[v])
            for m in mine
        )
        size = record_size(max(len(m) for m in mine), docs_max)
        rec = encode_record(
            size, counts, ended, [len(r["input_ids"]) for r in rows], [loss_tokens(r) for r in rows], error
        )
        records = all_gather_records(rec, s.group, s.world)
        taken, lengths, losses, owner = self._assemble(records, mine, cur, index)
        after = Cursor(list(cur.specs), [p + t for p, t in zip(cur.pos, taken)], list(cur.ended))
        history, self.history = self.history, []
        if self.forced is not None:
            after.ended = [bool(e) for e in self._forced_after]
            self.forced = self._forced_after = self._forced_digest = None
        else:
            after.ended = [bool(e) or bool(x) for e, x in zip(cur.ended, self._ended_all)]
        ended_after = list(after.ended)
        if self.resplit is not None:
            after = self._resplit(after)
            self.reader.close_except(after.specs)
        self.cursor = after
        if len(lengths) == 0:
            return None
        seed = window_seed(s.seed, s.epoch, index, _NOT_WINDOWED)
        try:
            seg = replan_units(lengths, topology, cost, seed, s.overflow, history)
        except ValueError as e:
            raise ValueError(f"window {index} of the stream ({len(lengths)} documents): {e}") from None
        win = Window(index, cur.copy(), taken, after.copy(), lengths, losses, seg, history, ended_after)
        self._exchange(win, rows, owner)
        return win

    def _read(self, my_streams: list[int], cur: Cursor, q, reserve: int):
        rows, counts, ended, error = [], [], [], None
        try:
            for v in my_streams:
                if cur.ended[v] and self.forced is None:
                    counts.append(0)
                    ended.append(True)
                    continue
                forced = None if self.forced is None else int(self.forced[v])
                got, end = self.reader.take(cur.specs[v], cur.pos[v], int(q[v]), reserve, forced)
                rows += got
                counts.append(len(got))
                ended.append(end)
        except Exception as e:  # reported through the gather so that every rank raises, none waits
            error = f"{type(e).__name__}: {e}"
            rows, counts, ended = [], [0] * len(my_streams), [False] * len(my_streams)
        return error, rows, counts, ended

    def _assemble(self, records, mine, cur: Cursor, index: int):
        """Per-stream counts, and the window's lengths, loss tokens and (rank, local index) owners in window order."""
        n_streams = len(cur.specs)
        taken = [0] * n_streams
        self._ended_all = [False] * n_streams
        per_stream: dict[int, tuple] = {}
        for r, (rec, streams) in enumerate(zip(records, mine)):
            error, counts, ended, lengths, losses = decode_record(rec, len(streams))
            if error is not None:
                raise StreamSourceError(f"the stream's source failed on rank {r} while reading window {index}: {error}")
            at = 0
            for v, c, e in zip(streams, counts, ended):
                c = int(c)
                per_stream[v] = (lengths[at : at + c], losses[at : at + c], r, np.arange(at, at + c))
                taken[v], self._ended_all[v] = c, bool(e)
                at += c
        if self.forced is not None:
            for v in range(n_streams):
                if taken[v] != self.forced[v]:
                    raise ValueError(
                        f"resuming window {index}: stream {v} ({cur.specs[v]}) now has {taken[v]} items from item "
                        f"{cur.pos[v]} on, the state recorded {self.forced[v]}: the source changed"
                    )
        parts = [per_stream[v] for v in range(n_streams)]
        lengths = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.int64)
        losses = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, np.int64)
        owner_rank = np.concatenate([np.full(len(p[0]), p[2]) for p in parts]) if parts else np.zeros(0, np.int64)
        owner_local = np.concatenate([p[3] for p in parts]) if parts else np.zeros(0, np.int64)
        if self._forced_digest is not None and lengths_digest(lengths) != self._forced_digest:
            raise ValueError(
                f"resuming window {index}: its documents' lengths differ from those the state recorded: the source "
                "changed"
            )
        return taken, lengths, losses, (owner_rank, owner_local)

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
        s.meter.add(held - kept_own)  # received from others: held alongside what was read until it is dropped
        s.meter.add(-(read - kept_own))
