"""Sampler inputs: document lengths from arrays, pretokenized folders, `ShardDataset`s or `datasets.Dataset`
columns, and the lengths fingerprint a resume state is checked against.

An integer array (a memory-mapped `.npy` or a pretokenized folder's `ShardedArray` included) is used as it is,
never copied whole: it is checked, summed and fingerprinted in chunks of `CHUNK` documents (`scan_lengths`)."""

from __future__ import annotations

import hashlib
import mmap
import os
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from balancer.data.shards.sharded import ShardedArray
from balancer.planning.units import validate_lengths


def resolve_lengths(lengths: Any, dataset: Any = None) -> tuple[np.ndarray, Optional[int]]:
    """Lengths from an array/list, a pretokenized folder or lengths file path, a `ShardDataset` (`.lengths`), a
    `datasets.Dataset` (its `input_ids` column), or a column name of `dataset`. Returns (lengths, dataset size)."""
    src = lengths
    if isinstance(src, (str, os.PathLike)):
        if dataset is not None and isinstance(src, str) and _is_hf_dataset(dataset) and src in dataset.column_names:
            arr = np.asarray(_hf_column(dataset, src))
            if arr.dtype == object or arr.ndim != 1:  # a list column (e.g. input_ids): lengths of its rows
                arr = np.asarray(_hf_list_lengths(dataset, src))
        else:  # a folder or a .npy file: mapped, never read whole
            from balancer.data.shards.lengths import map_lengths

            arr = map_lengths(src)
    elif hasattr(src, "lengths") and not isinstance(src, np.ndarray):  # ShardDataset and alike
        arr = src.lengths if _array_like(src.lengths) else np.asarray(src.lengths)
        if dataset is None:
            dataset = src
    elif _is_hf_dataset(src):
        if "input_ids" not in src.column_names:
            raise ValueError(
                f"the datasets.Dataset has no 'input_ids' column (columns: {src.column_names}); pass "
                "lengths='<column>', dataset=ds or a lengths array"
            )
        arr = np.asarray(_hf_list_lengths(src, "input_ids"))
        if dataset is None:
            dataset = src
    else:
        arr = src if _array_like(src) else np.asarray(src)
    arr = arr if _plain_ints(arr) else validate_lengths(arr)
    n_ds = None
    if dataset is not None:
        n_ds = len(dataset)
        if n_ds != len(arr):
            raise ValueError(
                f"lengths has {len(arr)} entries but the dataset has {n_ds} items: the lengths do not match the dataset"
            )
    return arr, n_ds


def _is_hf_dataset(x) -> bool:
    try:
        import datasets
    except ImportError:  # pragma: no cover
        return False
    return isinstance(x, datasets.Dataset)


def _hf_column(ds, name: str):
    tbl = ds.with_format("arrow")[:]
    return tbl.column(name).to_numpy(zero_copy_only=False)


def _hf_list_lengths(ds, name: str) -> np.ndarray:
    import pyarrow.compute as pc

    tbl = ds.with_format("arrow")[:]
    return pc.list_value_length(tbl.column(name)).to_numpy(zero_copy_only=False).astype(np.int64)


CHUNK = 1 << 20


@dataclass(frozen=True)
class LengthsSummary:
    """What one pass over the lengths gives: document count, total tokens, the longest document and the
    fingerprint a resume state is checked against."""

    num_docs: int
    total_tokens: int
    longest: int
    longest_doc: int
    fingerprint: str


def _array_like(x) -> bool:
    """An array used in place: an ndarray or a pretokenized folder's `ShardedArray` (gathers and slices read only
    what they ask for)."""
    return isinstance(x, (np.ndarray, ShardedArray))


def _plain_ints(arr: np.ndarray) -> bool:
    """A 1-D signed or unsigned integer array, checked in scan_lengths without a copy (int64 or narrower)."""
    return arr.ndim == 1 and arr.dtype.kind in "iu" and arr.dtype.itemsize <= 8 and len(arr) > 0


def scan_lengths(lengths: np.ndarray, name: str = "lengths") -> LengthsSummary:
    """One chunked pass: every length >= 1 (ValueError naming the first bad document), the total, the longest and
    the fingerprint (sha256 of the int64 values, as `fingerprint_lengths`). Memory: one chunk."""
    sha = hashlib.sha256()
    total, longest, longest_doc = 0, -1, 0
    for first in range(0, len(lengths), CHUNK):
        raw = lengths[first : first + CHUNK]
        if raw.dtype == np.uint64 and int(raw.max()) >= 1 << 63:
            i = first + int(np.argmax(raw >= np.uint64(1 << 63)))
            raise ValueError(f"{name}[{i}] = {int(raw[i - first])} is out of range (lengths are 1 .. 2**63-1)")
        chunk = np.asarray(raw, dtype=np.int64)
        low = int(chunk.min())
        if low <= 0:
            i = first + int(np.argmax(chunk <= 0))
            raise ValueError(f"{name}[{i}] = {low} : document {i} has no tokens (lengths must be >= 1)")
        top = int(chunk.argmax())
        if int(chunk[top]) > longest:
            longest, longest_doc = int(chunk[top]), first + top
        total += int(chunk.sum())
        sha.update(chunk.tobytes())
    return LengthsSummary(len(lengths), total, longest, longest_doc, sha.hexdigest()[:32])


def fingerprint_lengths(lengths: np.ndarray) -> str:
    return scan_lengths(lengths).fingerprint


def backing_files(lengths: Any) -> list[str]:
    """The files a memory-mapped lengths array reads (a `.npy` map, a folder's shard index files); [] in memory."""
    if isinstance(lengths, ShardedArray):
        return sorted({str(f) for f, _, _ in lengths._files})
    # a whole-file map (np.load(mmap_mode=...)), not a view of one: its file holds exactly these lengths
    if isinstance(lengths, np.memmap) and isinstance(lengths.base, mmap.mmap) and getattr(lengths, "filename", None):
        return [str(lengths.filename)]
    return []


def _stamp(path: str):
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_size, st.st_mtime_ns, st.st_ino)


class LengthsGuard:
    """Notices when the files behind memory-mapped lengths change while an epoch is planned from them: `check()`
    before a window's lengths are read. A file deleted or of another size is refused at once (reading a truncated
    map would be a SIGBUS); one rewritten (new mtime or inode) has its lengths fingerprinted again and is refused
    unless they are the same as when the sampler was built (a change undone is no change). Never a plan mixing new
    and old lengths: a window is planned from one read, after its check."""

    def __init__(self, lengths, fingerprint: str) -> None:
        self.files = backing_files(lengths)
        self.stamps = {f: _stamp(f) for f in self.files}
        self.fingerprint = fingerprint
        self._source = lengths

    def check(self, where: str) -> None:
        for f in self.files:
            now, then = _stamp(f), self.stamps[f]
            if now == then:
                continue
            if now is None:
                raise ValueError(f"{f}: the lengths file was deleted during the epoch (before {where}); restore it")
            if now[0] != then[0]:
                raise ValueError(
                    f"{f}: the lengths file changed size during the epoch ({then[0]} -> {now[0]} bytes, before "
                    f"{where}); restore it or start a new sampler on the new lengths"
                )
            fresh = _fresh(self._source, f)
            if scan_lengths(fresh).fingerprint != self.fingerprint:
                raise ValueError(
                    f"{f}: the lengths file was rewritten during the epoch (before {where}) with other lengths; "
                    "restore it or start a new sampler on the new lengths"
                )
            self.stamps[f] = now  # rewritten with the same lengths: nothing changed

    def __getstate__(self) -> dict:
        return dict(self.__dict__)


def _fresh(source, path: str):
    """The lengths as the files hold them now (mapped again: a replaced file is not the old map's inode)."""
    if isinstance(source, ShardedArray):
        from balancer.data.shards.sharded import _remap

        return _remap(source._files)
    fresh = np.load(path, mmap_mode="r", allow_pickle=False)
    if len(fresh) != len(source):
        raise ValueError(f"{path}: the lengths file now holds {len(fresh)} documents, not {len(source)}")
    return fresh
