"""The epoch's shuffle and its windows: a keyed bijection of `[0, num_docs)` and the contiguous blocks of it that
windowed planning plans one at a time (balancer.planning.window; docs/windows.md).

The shuffle is a Feistel network over the next power of four, made exact by cycle walking: the documents at shuffle
positions `[a, b)` are computed in O(b - a) time and memory, with no permutation of the whole epoch in memory. This
module is the light half of windowed planning (NumPy only), so plan files and their checks can name a window's
documents without importing the planner.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_ROUNDS = 6
_SHUFFLE_TAG = 0x77696E64  # keeps the shuffle's keys apart from any other use of (seed, epoch)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on a uint64 array (wrapping arithmetic): the Feistel round function."""
    z = z ^ (z >> np.uint64(30))
    z = z * _M1
    z = z ^ (z >> np.uint64(27))
    z = z * _M2
    return z ^ (z >> np.uint64(31))


class EpochShuffle:
    """The shuffle of an epoch as a bijection `position -> document id` of `[0, num_docs)`, keyed by (seed, epoch).

    `shuffle(positions)` maps any positions in O(len(positions)); nothing of size `num_docs` is ever built."""

    def __init__(self, num_docs: int, seed: int, epoch: int) -> None:
        self.num_docs = int(num_docs)
        bits = max(2, (self.num_docs - 1).bit_length())
        self._half = np.uint64((bits + 1) // 2)
        self._mask = np.uint64((1 << int(self._half)) - 1)
        self._keys = np.random.SeedSequence([_SHUFFLE_TAG, int(seed), int(epoch)]).generate_state(_ROUNDS, np.uint64)

    def _permute(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self._half, x & self._mask
        for key in self._keys:
            left, right = right, left ^ (_mix(right ^ key) & self._mask)
        return (left << self._half) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        x = np.asarray(positions, dtype=np.uint64).copy()
        if len(x) and int(x.max()) >= self.num_docs:
            raise ValueError(f"shuffle positions must be below num_docs = {self.num_docs}")
        todo = np.arange(len(x))
        while len(todo):  # cycle walking: a value outside [0, num_docs) is permuted again until it lands inside
            x[todo] = self._permute(x[todo])
            todo = todo[x[todo] >= self.num_docs]
        return x.astype(np.int64)


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
