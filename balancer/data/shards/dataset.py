"""Reading a finished `balancer pretokenize` folder (layout: see `balancer.data.shards`): `ShardDataset`
(memory-mapped rows, checked on open)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from balancer.data.shards.arrow_rows import open_arrow
from balancer.data.shards.checks import open_folder
from balancer.data.shards.sharded import ShardedArray
from balancer.data.shards.verify import require_verified


class ShardDataset(torch.utils.data.Dataset):
    """Map-style dataset over a finished pretokenize folder: `len(ds)` rows, `ds[i]` ->
    {"input_ids": LongTensor, "doc_id": int}. `.lengths` / `.doc_ids` (read-only int64 `ShardedArray`s) are the
    memory-mapped index files, read as one array without a copy and without touching the token data. Shards are
    memory-mapped lazily, per process (safe with DataLoader workers).

    Opening checks the manifest, the index files (sha256) and the Arrow row counts (`balancer.data.shards.checks`);
    `check="full"` also reads and checks every byte (`verify`). DataError names the file otherwise."""

    def __init__(self, path: str | os.PathLike, check: str = "index") -> None:
        if check not in ("index", "full"):
            raise ValueError(f"check must be 'index' or 'full', got {check!r}")
        self.path = Path(path)
        opened = open_folder(self.path)
        if check == "full":
            require_verified(self.path)
        self.manifest = opened.manifest
        self._names = [e["name"] for e in self.manifest["shards"]]
        self.lengths: ShardedArray = opened.lengths_view()
        self.doc_ids: ShardedArray = opened.doc_ids_view()
        self._row_starts = np.concatenate([[0], np.cumsum([len(x) for x in opened.shard_lengths])]).astype(np.int64)
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
            table = open_arrow(self.path / f"{self._names[s]}.arrow")
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
