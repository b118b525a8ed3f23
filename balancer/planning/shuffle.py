"""The epoch's shuffle and its windows: a keyed bijection of `[0, num_docs)` and the contiguous blocks of it that
windowed planning plans one at a time (balancer.planning.window; docs/windows.md).

The shuffle is a Feistel network over the next power of four, made exact by cycle walking: the documents at shuffle
positions `[a, b)` are computed in O(b - a) time and memory, with no permutation of the whole epoch in memory. This
module is the light half of windowed planning (NumPy only), so plan files and their checks can name a window's
documents without importing the planner.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

_ROUNDS = 6
_SHUFFLE_TAG = 0x77696E64  # keeps the shuffle's keys apart from any other use of (seed, epoch)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_CHUNK = 1 << 16
_TABLE_HALF_BITS = 20  # round functions of halves up to this many bits are tables (8 MiB at most)
_BATCH = 1 << 15  # documents per pass of `positions_of_runs`: its arrays stay in the L2 cache


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on a uint64 array (wrapping arithmetic): the Feistel round function."""
    z = z ^ (z >> np.uint64(30))
    z = z * _M1
    z = z ^ (z >> np.uint64(27))
    z = z * _M2
    return z ^ (z >> np.uint64(31))


class EpochShuffle:
    """The shuffle of an epoch as a bijection `position -> document id` of `[0, num_docs)`, keyed by (seed, epoch).

    `shuffle(positions)` maps any positions in O(len(positions)), `shuffle.inverse(ids)` gives the positions of
    document ids; nothing of size `num_docs` is ever built. Below 2**40 documents each round function is a table of
    `2**half` entries (its values depend on one half only), looked up instead of computed: the same bijection,
    several times faster."""

    def __init__(self, num_docs: int, seed: int, epoch: int) -> None:
        self.num_docs = int(num_docs)
        bits = max(2, (self.num_docs - 1).bit_length())
        self._half = np.uint64((bits + 1) // 2)
        self._mask = np.uint64((1 << int(self._half)) - 1)
        self._keys = np.random.SeedSequence([_SHUFFLE_TAG, int(seed), int(epoch)]).generate_state(_ROUNDS, np.uint64)
        self._tables: list[np.ndarray] = []  # none above _TABLE_HALF_BITS: the plain walk
        self._dtype = np.int32 if int(self._half) <= 15 else np.int64
        if int(self._half) <= _TABLE_HALF_BITS:
            domain = np.arange(1 << int(self._half), dtype=np.uint64)
            self._tables = [(_mix(domain ^ key) & self._mask).astype(self._dtype) for key in self._keys]

    def _permute(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self._half, x & self._mask
        for key in self._keys:
            left, right = right, left ^ (_mix(right ^ key) & self._mask)
        return (left << self._half) | right

    def _walk(self, x: np.ndarray, inverse: bool) -> np.ndarray:
        """Cycle walking: every value is mapped (Feistel network, or its inverse) until it lands in [0, num_docs)."""
        if len(x) > _CHUNK:  # chunks that stay in cache
            return np.concatenate([self._walk(x[a : a + _CHUNK], inverse) for a in range(0, len(x), _CHUNK)])
        step = self._tabled if self._tables else self._direct
        out = step(x, inverse)
        todo = np.flatnonzero(out >= self.num_docs)
        while len(todo):
            y = step(out[todo], inverse)
            out[todo] = y
            todo = todo[y >= self.num_docs]
        return out

    def _direct(self, x: np.ndarray, inverse: bool) -> np.ndarray:
        x = x.astype(np.uint64)
        if not inverse:
            return self._permute(x).astype(np.int64)
        right, left = x >> self._half, x & self._mask  # the rounds backwards: swap the halves' roles
        for key in self._keys[::-1]:
            left, right = right, left ^ (_mix(right ^ key) & self._mask)
        return ((right << self._half) | left).astype(np.int64)

    def _tabled(self, x: np.ndarray, inverse: bool) -> np.ndarray:
        half, dtype = int(self._half), self._tables[0].dtype
        x = x.astype(dtype, copy=False)  # the tables' type
        a, b = x >> half, x & int(self._mask)  # forward: a = left, b = right; inverse: a = right, b = left
        if inverse:
            a, b = b, a
        for table in self._tables[::-1] if inverse else self._tables:
            c = table.take(b, mode="clip")  # every index is a half, in range: "clip" skips the bounds check
            c ^= a
            a, b = b, c
        if inverse:
            a, b = b, a
        a <<= half  # int32 tables: the domain is below 2**30, so the value fits
        a |= b
        return a

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        x = np.asarray(positions)
        if len(x) and (int(x.max()) >= self.num_docs or int(x.min()) < 0):
            raise ValueError(f"shuffle positions must be in [0, num_docs = {self.num_docs})")
        return self._walk(x.astype(self._dtype), inverse=False).astype(np.int64, copy=False)

    def inverse(self, ids: np.ndarray) -> np.ndarray:
        """The shuffle positions of document `ids` (O(len(ids)))."""
        x = np.asarray(ids)
        if len(x) and (int(x.max()) >= self.num_docs or int(x.min()) < 0):
            raise ValueError(f"document ids must be in [0, num_docs = {self.num_docs})")
        return self._walk(x.astype(self._dtype), inverse=True).astype(np.int64, copy=False)

    def inverse_small(self, ids: np.ndarray) -> np.ndarray:
        """`inverse` in the narrowest integer type that holds the positions (int32 below 2**30 documents)."""
        return self._walk(np.asarray(ids).astype(self._dtype), inverse=True)

    def positions_of_runs(
        self, runs: Iterable[tuple[int, np.ndarray]], batch: int = _BATCH
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The shuffle positions of runs of consecutive documents: for runs `(first, values)` (documents `first,
        first + 1, ...`, one value each), yields `(positions, values)` of the documents whose positions are known,
        every document of the runs exactly once, in no particular order; positions in the narrowest integer type.

        The same positions as `inverse`, cheaper: a document whose cycle walk is still outside `[0, num_docs)`
        waits for the next pass together with new documents, so every pass runs the Feistel rounds on a full batch
        of `batch` (the halves kept apart between passes), and nothing is scattered back into order. O(documents)
        time, O(batch) memory."""
        if not self._tables:  # 2**40 documents or more: no tables, the plain walk
            for first, values in runs:
                yield self.inverse(np.arange(first, first + len(values), dtype=np.uint64)), np.asarray(values)
            return
        dtype = self._tables[0].dtype
        # documents still walking: where their walk is, and their values
        wait, wait_values = np.zeros(0, dtype=dtype), np.zeros(0)
        for first, values in runs:
            values = np.asarray(values)
            at = 0
            while at < len(values):
                waiting = len(wait)
                take = min(len(values) - at, max(batch - waiting, batch // 4))
                x, v = np.arange(first + at, first + at + take, dtype=dtype), values[at : at + take]
                if waiting:
                    x, v = np.concatenate((wait, x)), np.concatenate((wait_values, v))
                at += take
                positions, done, wait, wait_values = self._pass_back(x, v)
                yield positions, done
        while len(wait):
            positions, done, wait, wait_values = self._pass_back(wait, wait_values)
            yield positions, done

    def _pass_back(self, x: np.ndarray, values: np.ndarray) -> tuple:
        """One step of the inverse walk for every value of `x` (the tables' type): (positions, values) of those that
        landed in [0, num_docs), then (where the walk is, values) of the rest."""
        half = int(self._half)
        a, b = x & int(self._mask), x >> half  # the inverse rounds: a = the right half, b = the left
        for table in self._tables[::-1]:
            c = table.take(b, mode="clip")  # every index is a half, in range: "clip" skips the bounds check
            c ^= a
            a, b = b, c
        b <<= half  # int32 tables: the domain is below 2**30, so the value fits
        b |= a
        inside = b < self.num_docs
        keep, wait = np.flatnonzero(inside), np.flatnonzero(~inside)
        if not len(wait):
            return b, values, b[:0], values[:0]
        # index arrays and take: several times faster than boolean masks on a random mask
        return tuple(y.take(i, mode="clip") for i in (keep, wait) for y in (b, values))


def num_windows(num_docs: int, window_docs: int) -> int:
    """Windows of an epoch of `num_docs` documents: ceil(num_docs / window_docs), less one when the rest is under a
    quarter window (it joins the window before)."""
    k = -(-int(num_docs) // int(window_docs))
    rest = num_docs - (k - 1) * window_docs
    return k - 1 if k > 1 and 4 * rest < window_docs else k


def window_range(num_docs: int, window_docs: int, index: int) -> tuple[int, int]:
    """Shuffle positions [first, stop) of window `index`."""
    k = num_windows(num_docs, window_docs)
    if not 0 <= index < k:
        raise ValueError(f"index {index} out of range: {num_docs} documents in windows of {window_docs} make {k}")
    first = index * window_docs
    return first, num_docs if index == k - 1 else first + window_docs


def window_ids(num_docs: int, seed: int, epoch: int, index: int, window_docs: int) -> np.ndarray:
    """Sorted global document ids of window `index` (O(window) time and memory)."""
    first, stop = window_range(num_docs, window_docs, index)
    if first == 0 and stop == num_docs:
        return np.arange(num_docs, dtype=np.int64)
    ids = EpochShuffle(num_docs, seed, epoch)(np.arange(first, stop, dtype=np.uint64))
    ids.sort()
    return ids


@dataclass(frozen=True)
class WindowInfo:
    """Where a window plan sits in its epoch: window `index` of `num_windows` of the epoch shuffled with (`seed`,
    `epoch`), shuffle positions [first, stop). Its documents are `ids()`: a plan file records this, not the ids."""

    seed: int
    epoch: int
    index: int
    num_windows: int
    window_docs: int
    first: int
    stop: int

    def ids(self, num_docs: int) -> np.ndarray:
        """The window's sorted global document ids."""
        return window_ids(num_docs, self.seed, self.epoch, self.index, self.window_docs)
