"""Which documents make a stream window: every rank reads its streams, the counts are gathered, and the rule below
decides, the same on every rank.

The streams not known to be finished split `window_docs` between them (`quotas`). Round 1: each live stream reads
its quota plus a share `ceil(reserve / live)` of the reserve (`reserve` = dp * micro_batches, the documents one
step needs); a stream that had them gives its quota to the window and *holds* the rest for the next window, one
that ran out gives everything and is finished. One all-gather shares, per stream, the documents it gives (their
lengths and loss-token counts), whether it finished, and how many it holds. While the unfinished streams hold
fewer than `reserve` documents between them (only near the end of the stream, when streams have finished),
another round asks each of them for `ceil(missing / unfinished)` more: a stream that runs out then gives all it
holds to this window. So a window is the last only when every stream is finished, and the one after it holds at
least `reserve` documents: the last window always fills a step, nothing dropped or padded, whichever rank's
shards end first. Documents are ordered by (stream, item) so that the window does not depend on who read what.
A resumed window reads exactly the counts its state recorded.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import numpy as np

from balancer.streaming.exchange import StreamSourceError, decode_record, encode_record, record_size
from balancer.streaming.sources import Source, StreamSpec, loss_tokens

if TYPE_CHECKING:
    from balancer.streaming.windows import Cursor


def quotas(ended: list[bool], window_docs: int) -> np.ndarray:
    """Documents each stream gives a window: `window_docs` split over the unfinished streams (earlier ones +1)."""
    live = [v for v, e in enumerate(ended) if not e]
    out = np.zeros(len(ended), dtype=np.int64)
    if live:
        base, extra = divmod(int(window_docs), len(live))
        for i, v in enumerate(live):
            out[v] = base + (i < extra)
    return out


class Reader:
    """This process's open streams: an iterator per stream and the items read ahead of the window they go to."""

    def __init__(self, source: Source, meter) -> None:
        self.source, self.meter = source, meter
        self._open: dict[StreamSpec, list] = {}  # spec -> [iterator, buffer, position of buffer[0], ended]

    def fill(self, spec: StreamSpec, pos: int, upto: int) -> tuple[int, bool]:
        """Read stream `spec` (its buffer starting at item `pos`) until `upto` items are buffered or it ends:
        (items buffered, ended)."""
        state = self._open.get(spec)
        if state is None or state[2] != pos:
            if state is not None:
                self.meter.add(-sum(len(r["input_ids"]) for r in state[1]))
            state = [self.source.read(spec, pos), collections.deque(), pos, False]
            self._open[spec] = state
        it, buf = state[0], state[1]
        while len(buf) < upto and not state[3]:
            try:
                row = next(it)
            except StopIteration:
                state[3] = True
                break
            buf.append(row)
            self.meter.add(len(row["input_ids"]))
        return len(buf), state[3]

    def pop(self, spec: StreamSpec, n: int) -> list:
        state = self._open[spec]
        rows = [state[1].popleft() for _ in range(n)]
        state[2] += n
        return rows

    def close_except(self, specs: Iterable) -> None:
        keep = set(specs)
        for spec in list(self._open):
            if spec not in keep:
                self.meter.add(-sum(len(r["input_ids"]) for r in self._open.pop(spec)[1]))


@dataclass
class Composition:
    """A window's documents: per stream the count and whether it finished; in window order the lengths, loss-token
    counts and owners (rank, index in that rank's `rows`); this rank's rows in the order it read them."""

    taken: list[int]
    ended: list[bool]
    lengths: np.ndarray
    losses: np.ndarray
    owner_rank: np.ndarray
    owner_local: np.ndarray
    rows: list


def compose(
    reader: Reader,
    cur: Cursor,
    mine: list[list[int]],
    rank: int,
    window_docs: int,
    reserve: int,
    forced: Optional[list[int]],
    gather: Callable[[np.ndarray], list[np.ndarray]],
) -> Composition:
    """The window starting at cursor `cur` (module docstring); `mine[r]` are rank r's streams, `forced` the counts
    of a resumed window (or None), `gather(record) -> records` one all-gather. A source error on any rank raises
    StreamSourceError on every rank."""
    n = len(cur.specs)
    q = quotas(cur.ended, window_docs)
    live = [v for v in range(n) if not cur.ended[v]]
    share = -(-reserve // len(live)) if live else 0
    taken, held = [0] * n, [0] * n
    ended = [bool(e) for e in cur.ended]
    parts: list[list] = [[] for _ in range(n)]  # per stream: (lengths, losses, rank, first local index) per round
    offsets = [0] * len(mine)  # rows each rank has read into this window so far
    rows: list = []

    def local_read(v: int, upto: int, final: bool) -> list:
        spec, pos = cur.specs[v], cur.pos[v] + taken[v]
        have, end = reader.fill(spec, pos, upto)
        if forced is not None:
            return reader.pop(spec, min(have, int(forced[v])))
        give = have if end else (0 if not final else min(have, int(q[v])))
        ended[v] = end
        return reader.pop(spec, give)

    plan = {v: (int(forced[v]) if forced is not None else int(q[v]) + share) for v in live}
    final = True
    while plan:
        error, new, counts = None, [], {}
        try:
            for v in mine[rank]:
                if v in plan:
                    got = local_read(v, plan[v] if final else held[v] + plan[v], final)
                    counts[v] = len(got)
                    new += got
        except Exception as e:  # reported through the gather so that every rank raises, none waits
            error, new, counts = f"{type(e).__name__}: {e}", [], {}
        per = np.array([[counts.get(v, 0), ended[v], _buffered(reader, cur, v, taken, counts)] for v in mine[rank]])
        docs = max(sum(plan.get(v, 0) + (0 if final else held[v]) for v in m) for m in mine)
        lens, losses = row_stats(new)
        record = encode_record(record_size(max(len(m) for m in mine), docs), per.reshape(-1, 3), lens, losses, error)
        _absorb(gather(record), mine, plan, taken, held, ended, parts, offsets)
        rows += new
        final = False
        alive = [v for v in range(n) if not ended[v]]
        missing = reserve - sum(held[v] for v in alive)
        if forced is not None or not alive or missing <= 0:
            break
        plan = {v: -(-missing // len(alive)) for v in alive}
    return _finish(parts, taken, ended, rows)


def _buffered(reader: Reader, cur, v: int, taken: list[int], counts: dict) -> int:
    """Items stream v holds beyond what it gave (0 for a stream this rank did not read this round)."""
    state = reader._open.get(cur.specs[v])
    return 0 if state is None or v not in counts else len(state[1])


def _absorb(records, mine, plan, taken, held, ended, parts, offsets) -> None:
    for r, (rec, streams) in enumerate(zip(records, mine)):
        error, per, lengths, losses = decode_record(rec, len(streams))
        if error is not None:
            raise StreamSourceError(f"the stream's source failed on rank {r}: {error}")
        at = 0
        for v, (c, e, h) in zip(streams, per.tolist()):
            if v not in plan:
                continue
            parts[v].append((lengths[at : at + c], losses[at : at + c], r, offsets[r]))
            taken[v] += c
            ended[v], held[v] = bool(e), int(h)
            at += c
            offsets[r] += c


def _finish(parts, taken, ended, rows) -> Composition:
    chunks = [p for stream in parts for p in stream]
    if not chunks:
        e = np.zeros(0, dtype=np.int64)
        return Composition(taken, ended, e, e, e, e, rows)
    return Composition(
        taken,
        ended,
        np.concatenate([p[0] for p in chunks]).astype(np.int64),
        np.concatenate([p[1] for p in chunks]).astype(np.int64),
        np.concatenate([np.full(len(p[0]), p[2], dtype=np.int64) for p in chunks]),
        np.concatenate([np.arange(p[3], p[3] + len(p[0]), dtype=np.int64) for p in chunks]),
        rows,
    )


def row_stats(rows: list) -> tuple[list[int], list[int]]:
    return [len(r["input_ids"]) for r in rows], [loss_tokens(r) for r in rows]
