"""What a `BalancedStream` reads: a source cut into parts, the parts cut into *streams*, and the rows they yield.

A source has `num_parts` parts that can be read independently: the shards of a Hugging Face streaming
`datasets.IterableDataset` (`ds.shard(n_shards, p)`), the shards of a pretokenized folder (rows read from the
memory-mapped Arrow files, seekable), or one part for a plain re-iterable Python iterable. A *stream* is
`(part, stride, offset)`: the items of that part at positions `offset, offset + stride, ...`. Streams depend on
the source and the number of reading ranks only, never on what was read, and a stream's remainder can be cut into
finer streams of the same form (`split_streams`): that is what lets a saved state resume on another number of ranks.

Which rank reads what (`initial_streams`, `assign`): with at least as many parts as ranks every part is one stream
and rank `r` reads the parts `p` with `p % world == r` (whole shards; when they do not divide, some ranks read one
part more). With fewer parts than ranks each part is read by `world / parts` ranks (rounded: `world // parts` or one
more) that keep every `m`-th item each: every one of them reads the whole part and keeps its share (a plain
iterable: every rank iterates it and keeps every world-th item).
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

IGNORE_INDEX = -100


@dataclass(frozen=True)
class StreamSpec:
    """Items `offset, offset + stride, ...` of part `part`."""

    part: int
    stride: int
    offset: int


def initial_streams(num_parts: int, world: int) -> list[StreamSpec]:
    """The streams of a fresh pass (module docstring): one per part, or `world` streams when parts are fewer."""
    if num_parts >= world:
        return [StreamSpec(p, 1, 0) for p in range(num_parts)]
    out = []
    for p in range(num_parts):
        m = world // num_parts + (p < world % num_parts)
        out += [StreamSpec(p, m, j) for j in range(m)]
    return out


def split_streams(streams: list[StreamSpec], positions: list[int], world: int) -> tuple[list[StreamSpec], list[int]]:
    """The remainders of `streams` (stream `v` read up to item `positions[v]`) as streams for `world` ranks: kept as
    they are when they are at least `world`, otherwise each cut into finer streams (position 0) so there are
    `world` of them. A finer stream of `(p, s, o)` read up to `c` is `(p, s*m, o + s*(c + j))` for `j < m`."""
    if len(streams) >= world:
        return list(streams), list(positions)
    out, pos = [], []
    for v, (spec, c) in enumerate(zip(streams, positions)):
        m = world // len(streams) + (v < world % len(streams))
        for j in range(m):
            out.append(StreamSpec(spec.part, spec.stride * m, spec.offset + spec.stride * (c + j)))
            pos.append(0)
    return out, pos


def assign(num_streams: int, world: int) -> list[list[int]]:
    """The streams each rank reads: stream `v` goes to rank `v % world`."""
    return [list(range(r, num_streams, world)) for r in range(world)]


def to_row(item: Any, where: str) -> dict:
    """A source item as a row: a dict with `input_ids` as int64 numpy (other columns untouched), or a sequence of
    token ids as `{"input_ids": ...}`. One ValueError naming `where` for anything else or an empty document."""
    if isinstance(item, dict) or (hasattr(item, "keys") and hasattr(item, "__getitem__")):
        row = dict(item)
        if "input_ids" not in row:
            raise ValueError(f"{where}: a row without 'input_ids' (columns {sorted(row)})")
    elif isinstance(item, (str, bytes)):
        raise ValueError(
            f"{where}: a {type(item).__name__}, not token ids: tokenize the stream first (docs/streaming.md)"
        )
    else:
        row = {"input_ids": item}
    ids = row["input_ids"]
    if hasattr(ids, "numpy") and not isinstance(ids, np.ndarray):
        ids = ids.numpy()
    arr = np.asarray(ids)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(
            f"{where}: 'input_ids' must be a 1-D sequence of integer token ids, got {arr.dtype} {arr.shape}"
        )
    if arr.size == 0:
        raise ValueError(f"{where}: an empty document (no input_ids): documents need >= 1 token")
    row["input_ids"] = arr.astype(np.int64, copy=False)
    return row


def loss_tokens(row: dict) -> int:
    """Tokens with a next-token target, as `PackedCollator` counts them: `n - 1`, or with `labels` the positions
    `t < n - 1` whose `labels[t + 1]` is not -100."""
    labels = row.get("labels")
    if labels is None:
        return len(row["input_ids"]) - 1
    lab = np.asarray(labels)
    return int((lab[1:] != IGNORE_INDEX).sum())


class Source:
    """A source's parts (module docstring). `kind`, `num_parts` and `fingerprint` identify it in a state."""

    kind = "iterable"

    def __init__(self, data) -> None:
        self.data = data
        self.num_parts = 1

    @property
    def fingerprint(self) -> str:
        return f"{self.kind}:{self.num_parts}"

    def set_epoch(self, epoch: int) -> None:
        """Forwarded to the source where it has `set_epoch` (a seeded shuffle buffer reshuffles per epoch)."""
        if hasattr(self.data, "set_epoch"):
            self.data.set_epoch(epoch)

    def _part(self, part: int):
        return self.data

    def read(self, spec: StreamSpec, start: int) -> Iterator[dict]:
        """The rows of stream `spec` from its item `start` on (earlier items are read and skipped: a stream cannot
        seek, except a pretokenized folder's)."""
        it = iter(self._part(spec.part))
        first = spec.offset + spec.stride * start
        for k, item in enumerate(itertools.islice(it, first, None, spec.stride)):
            yield to_row(item, f"{self.kind} source part {spec.part}, item {first + k * spec.stride}")


class HFSource(Source):
    """A `datasets.IterableDataset`: its shards are the parts."""

    kind = "hf"

    def __init__(self, data) -> None:
        super().__init__(data)
        self.num_parts = int(data.num_shards)

    def _part(self, part: int):
        return self.data.shard(num_shards=self.num_parts, index=part, contiguous=True)


class FolderSource(Source):
    """A pretokenized folder (`balancer pretokenize` output) read shard by shard through `ShardDataset`."""

    kind = "folder"

    def __init__(self, path) -> None:
        from balancer.data.shards.dataset import ShardDataset

        ds = ShardDataset(path)
        super().__init__(ds)
        self.starts = ds._row_starts
        self.num_parts = len(self.starts) - 1
        digest = hashlib.sha256(np.asarray(self.starts, dtype=np.int64).tobytes()).hexdigest()[:16]
        self._fp = f"folder:{self.num_parts}:{digest}"

    @property
    def fingerprint(self) -> str:
        return self._fp

    def read(self, spec: StreamSpec, start: int) -> Iterator[dict]:
        lo, hi = int(self.starts[spec.part]), int(self.starts[spec.part + 1])
        ds = self.data
        for i in range(lo + spec.offset + spec.stride * start, hi, spec.stride):
            yield {"input_ids": np.array(ds.token_ids(i), dtype=np.int64), "doc_id": int(ds.doc_ids[i])}


def open_source(source: object) -> Source:
    """The `Source` of what `BalancedStream` was given (module docstring); one TypeError for anything else."""
    try:
        import datasets
    except ImportError:  # pragma: no cover - datasets is a dependency of the data extras
        datasets = None
    if datasets is not None and isinstance(source, datasets.IterableDataset):
        return HFSource(source)
    if datasets is not None and isinstance(source, datasets.Dataset):
        raise TypeError(
            "source is a map-style datasets.Dataset: use BalancedBatchSampler, or dataset.to_iterable_dataset()"
        )
    if isinstance(source, (str, os.PathLike)):
        if not Path(source).is_dir():
            raise ValueError(f"source {str(source)!r} is not a pretokenized folder (not a directory)")
        return FolderSource(source)
    if isinstance(source, Iterator) or not hasattr(source, "__iter__"):
        once = " (an iterator: it can be read only once)" if isinstance(source, Iterator) else ""
        raise TypeError(
            "source must be a datasets.IterableDataset, a pretokenized folder or a re-iterable iterable (a list, a "
            f"dataset), got {type(source).__name__}{once}"
        )
    return Source(source)
