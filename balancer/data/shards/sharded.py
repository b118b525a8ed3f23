"""`ShardedArray`: a pretokenized folder's per-shard index files (lengths, doc_ids) read as one int64 array without
concatenating them: each shard's `.npy` is memory-mapped, gathers and slices read only the entries asked for.

It is what `ShardDataset.lengths` / `.doc_ids` and the sampler's folder lengths are: the windowed planner gathers a
window's lengths from it (O(window) memory). Reductions (`sum`, `min`, `max`) run shard by shard. Anything else that
needs an ndarray (`np.asarray(a)`, a NumPy function, an operator) gets a whole copy, made on that request only.
Pickling records the files, not the values (a DataLoader worker maps them again).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt

from balancer.data.shards.mapped import map_readonly

INT64 = np.dtype(np.int64)


def map_index(path: str | os.PathLike, offset: int, count: int) -> np.ndarray:
    """`count` int64 values at byte `offset` of the file `path`, memory-mapped read-only (no copy)."""
    if count == 0:
        return np.zeros(0, dtype=np.int64)
    return np.frombuffer(map_readonly(path), dtype="<i8", count=count, offset=offset).view(np.ndarray)


class ShardedArray(np.lib.mixins.NDArrayOperatorsMixin):
    """Read-only 1-D int64 array made of `parts` (one per shard, in order), each described by its file, byte
    offset and count (`files`) so that a pickled copy maps them again."""

    dtype = INT64
    ndim = 1

    def __init__(self, parts: list[np.ndarray], files: list[tuple[str, int, int]]) -> None:
        self._parts = parts
        self._files = files
        self._starts = np.concatenate([[0], np.cumsum([len(p) for p in parts], dtype=np.int64)]).astype(np.int64)

    def __reduce__(self):
        return (_remap, (self._files,))

    def __len__(self) -> int:
        return int(self._starts[-1])

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    @property
    def size(self) -> int:
        return len(self)

    @property
    def nbytes(self) -> int:
        return 8 * len(self)

    def __repr__(self) -> str:
        return f"ShardedArray({len(self)} int64 values in {len(self._parts)} shards)"

    def chunks(self) -> Iterator[np.ndarray]:
        """The values shard by shard (views of the memory maps)."""
        yield from (p for p in self._parts if len(p))

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step == 1:
                return self._range(start, max(start, stop))
            return self._gather(np.arange(start, stop, step, dtype=np.int64))
        if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
            i = int(key) + (len(self) if key < 0 else 0)
            if not 0 <= i < len(self):
                raise IndexError(f"index {int(key)} is out of bounds for {len(self)} values")
            s = int(np.searchsorted(self._starts, i, side="right")) - 1
            return self._parts[s][i - self._starts[s]]
        idx = np.asarray(key)
        if idx.dtype == bool:
            if idx.shape != self.shape:
                raise IndexError(f"boolean index of shape {idx.shape} for {len(self)} values")
            idx = np.flatnonzero(idx)
        if idx.dtype.kind not in "iu":
            raise IndexError(f"only integers, slices and integer or boolean arrays index a ShardedArray, got {key!r}")
        return self._gather(idx)

    def _range(self, start: int, stop: int) -> np.ndarray:
        first = int(np.searchsorted(self._starts, start, side="right")) - 1
        pieces = []
        s = first
        while s < len(self._parts) and self._starts[s] < stop:
            a, b = max(start, self._starts[s]) - self._starts[s], min(stop, self._starts[s + 1]) - self._starts[s]
            pieces.append(self._parts[s][a:b])
            s += 1
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)

    def _gather(self, idx: np.ndarray) -> np.ndarray:
        """Values at integer positions `idx` (any shape and order; negative counts from the end)."""
        flat = idx.astype(np.int64).ravel()
        n = len(self)
        flat = np.where(flat < 0, flat + n, flat)
        if len(flat) and (flat.min() < 0 or flat.max() >= n):
            bad = int(idx.ravel()[np.argmax((flat < 0) | (flat >= n))])
            raise IndexError(f"index {bad} is out of bounds for {n} values")
        shard = np.searchsorted(self._starts, flat, side="right") - 1
        order = np.argsort(shard, kind="stable")
        bounds = np.searchsorted(shard[order], np.arange(len(self._parts) + 1))
        out = np.empty(len(flat), dtype=np.int64)
        for s in np.flatnonzero(np.diff(bounds)):
            sel = order[bounds[s] : bounds[s + 1]]
            out[sel] = self._parts[s][flat[sel] - self._starts[s]]
        return out.reshape(idx.shape)

    # ---- whole-array requests --------------------------------------------------------------------------------
    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = self._range(0, len(self))
        return whole if dtype is None else whole.astype(dtype, copy=False)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        inputs = tuple(np.asarray(x) if isinstance(x, ShardedArray) else x for x in inputs)
        return getattr(ufunc, method)(*inputs, **kwargs)

    def __iter__(self) -> Iterator[np.int64]:
        for part in self.chunks():
            yield from part

    def tolist(self) -> list[int]:
        return [v for part in self.chunks() for v in part.tolist()]

    def astype(self, dtype: npt.DTypeLike, copy: bool = True) -> np.ndarray:
        return np.asarray(self).astype(dtype, copy=False)

    def sum(self) -> np.int64:
        return np.int64(sum(int(p.sum()) for p in self.chunks()))

    def min(self) -> np.int64:
        return self._reduce(np.min, "minimum")

    def max(self) -> np.int64:
        return self._reduce(np.max, "maximum")

    def _reduce(self, fn, what: str) -> np.int64:
        values = [fn(p) for p in self.chunks()]
        if not values:
            raise ValueError(f"zero-size array to reduction operation {what} which has no identity")
        return np.int64(fn(values))


def _remap(files: list[tuple[str, int, int]]) -> ShardedArray:
    return ShardedArray([map_index(Path(p), off, count) for p, off, count in files], files)
