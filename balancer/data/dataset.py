"""Reading a finished `balancer pretokenize` folder (layout: see `balancer.data.shards`): `load_manifest`,
`read_lengths` (the lengths index, or lengths from a .npy / .json file) and `ShardDataset` (memory-mapped rows).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from .manifest import FORMAT_NAME, FORMAT_VERSION, MANIFEST_NAME, load_manifest, shard_file_names  # noqa: F401
from .readers import PretokenizeError


def _open_arrow(path: Path) -> pa.Table:
    """Memory-mapped table of a shard (zero-copy)."""
    return pa.ipc.open_stream(pa.memory_map(str(path), "r")).read_all()


def read_lengths(path: str | os.PathLike) -> np.ndarray:
    """Per-row token lengths (int64, 1-D) from a pretokenized folder (its lengths index; no token data read), a
    `.npy` array, or a `.json` list of lengths (or an object with a "lengths" list). Raises ValueError naming the
    file when it holds something else."""
    p = Path(path)
    if p.is_dir():
        try:
            m = load_manifest(p)
        except PretokenizeError as exc:
            raise ValueError(str(exc)) from exc
        parts = [np.load(p / shard_file_names(e["name"])[1], allow_pickle=False) for e in m["shards"]]
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
    if not p.is_file():
        raise ValueError(f"{path}: no such file or directory")
    if p.suffix == ".npy":
        try:
            arr = np.load(p, allow_pickle=False)
        except Exception as exc:  # noqa: BLE001
            raise ValueError(f"{path}: not a readable .npy array ({exc})") from exc
    elif p.suffix == ".json":
        try:
            with open(p, encoding="utf-8") as f:
                data = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: invalid JSON ({exc})") from exc
        if isinstance(data, dict) and "lengths" in data:
            data = data["lengths"]
        if not isinstance(data, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in data):
            raise ValueError(f'{path}: expected a JSON list of integer lengths (or {{"lengths": [...]}})')
        arr = np.asarray(data, dtype=np.int64)
    else:
        raise ValueError(f"{path}: expected a pretokenized folder, a .npy or a .json file of lengths")
    if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"{path}: expected a 1-D integer array, got {arr.dtype} of shape {arr.shape}")
    if len(arr) and arr.min() < 0:
        raise ValueError(f"{path}: negative length at index {int(np.argmin(arr))}")
    return arr.astype(np.int64)


class ShardDataset(torch.utils.data.Dataset):
    """Map-style dataset over a finished pretokenize folder: `len(ds)` rows, `ds[i]` ->
    {"input_ids": LongTensor, "doc_id": int}. `.lengths` / `.doc_ids` (int64 numpy) come from the lengths index
    without touching the token data. Shards are memory-mapped lazily, per process (safe with DataLoader workers)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        m = load_manifest(self.path)
        self.manifest = m
        self._names = [e["name"] for e in m["shards"]]
        lens = [np.load(self.path / shard_file_names(n)[1], allow_pickle=False) for n in self._names]
        docs = [np.load(self.path / shard_file_names(n)[2], allow_pickle=False) for n in self._names]
        self.lengths: np.ndarray = np.concatenate(lens).astype(np.int64) if lens else np.zeros(0, np.int64)
        self.doc_ids: np.ndarray = np.concatenate(docs).astype(np.int64) if docs else np.zeros(0, np.int64)
        self._row_starts = np.concatenate([[0], np.cumsum([len(x) for x in lens])]).astype(np.int64)
        self._open: dict[int, tuple[np.ndarray, list]] = {}

    def __len__(self) -> int:
        return int(self._row_starts[-1])

    def __getstate__(self) -> dict:
        d = dict(self.__dict__)
        d["_open"] = {}
        return d

    def _shard(self, s: int) -> tuple[np.ndarray, list]:
        got = self._open.get(s)
        if got is None:
            table = _open_arrow(self.path / f"{self._names[s]}.arrow")
            chunks = table.column("input_ids").chunks
            starts = np.cumsum([0] + [len(c) for c in chunks]).astype(np.int64)
            got = (starts, [(c.offsets.to_numpy(), c.values.to_numpy()) for c in chunks])
            self._open[s] = got
        return got

    def token_ids(self, i: int) -> np.ndarray:
        """Row `i`'s ids as a read-only numpy view into the memory map (no copy)."""
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"row {i} out of range for {n} rows")
        s = int(np.searchsorted(self._row_starts, i, side="right") - 1)
        local = i - int(self._row_starts[s])
        starts, chunks = self._shard(s)
        c = int(np.searchsorted(starts, local, side="right") - 1)
        offs, vals = chunks[c]
        r = local - int(starts[c])
        return vals[offs[r] : offs[r + 1]]

    def __getitem__(self, i: int) -> dict:
        i = int(i)
        ids = self.token_ids(i)
        if i < 0:
            i += len(self)
        return {"input_ids": torch.from_numpy(ids.astype(np.int64)), "doc_id": int(self.doc_ids[i])}
