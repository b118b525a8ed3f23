"""Writing one shard (`ShardWriter`: Arrow stream + lengths and doc_id indexes, committed by rename) and the
`datasets` metadata that lets `datasets.load_from_disk` open a finished folder."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pyarrow as pa

from balancer.data.shards.manifest import (
    atomic_write_json,
    create_new_file,
    fsync_file,
    save_npy,
    sha256_file,
    shard_file_names,
)
from balancer.data.shards.output import DATASETS_DESCRIPTION, DATASETS_INFO, DATASETS_STATE
from balancer.temporaries import note_temporary

FLUSH_TOKENS = 1 << 20  # record batches of other row writers (balancer pack): at most ~1M tokens ...
FLUSH_ROWS = 4096  # ... or this many rows
# A shard's record batches: at most ~16M tokens or 64K rows. Large batches keep the open-time row count cheap
# (one header per batch; cold, each header is one random read) at ~32 MB of buffered uint16 ids.
SHARD_BATCH_TOKENS = 1 << 24
SHARD_BATCH_ROWS = 1 << 16


def shard_features(dtype: np.dtype) -> Any:
    """The `datasets.Features` of a shard."""
    import datasets

    return datasets.Features(
        {"input_ids": datasets.List(datasets.Value(np.dtype(dtype).name)), "doc_id": datasets.Value("int64")}
    )


def new_arrow_sink(path: Path) -> pa.NativeFile:
    """An Arrow output stream into a file created new at `path`, which must not exist (the output rules deleted a
    recorded leftover of ours; anything else there is refused) and is never opened through a symlink; its name is
    recorded (`note_temporary`) before it is created."""
    note_temporary(path, True)
    return pa.PythonFile(os.fdopen(create_new_file(path), "wb"), mode="w")


def crc32(data: bytes) -> int:
    """The CRC-32 (zlib) of `data`, as an unsigned int."""
    return zlib.crc32(data) & 0xFFFFFFFF


class ShardWriter:
    """Streams rows into `DIR/shard-NNNNN.*` files written under temporary names; `close()` makes them final."""

    def __init__(self, out: Path, index: int, schema: pa.Schema, dtype: np.dtype) -> None:
        self.out = out
        self.name = f"shard-{index:05d}"
        self.schema = schema
        self.dtype = dtype
        self.arrow_name, self.lengths_name, self.doc_ids_name = shard_file_names(self.name)
        for name in (self.lengths_name, self.doc_ids_name):  # recorded before they exist (close() creates them)
            note_temporary(out / (name + ".tmp"), True)
        self.tmp = out / (self.arrow_name + ".tmp")
        self.sink = new_arrow_sink(self.tmp)
        self.writer = pa.ipc.new_stream(self.sink, schema)
        self.buf_ids: list[np.ndarray] = []
        self.buf_docs: list[int] = []
        self.buf_tokens = 0
        self.all_lengths: list[np.ndarray] = []
        self.all_docs: list[np.ndarray] = []
        self.tokens = 0
        self.rows = 0
        self.documents = 0
        self._last_doc = -1

    def add(self, ids: np.ndarray, doc_id: int) -> None:
        """Append one row (a document or one window of it)."""
        ids = ids.astype(self.dtype)  # a copy in the shard's dtype: the encoder's batch array is not kept alive
        self.buf_ids.append(ids)
        self.buf_docs.append(doc_id)
        self.buf_tokens += len(ids)
        self.tokens += len(ids)
        self.rows += 1
        if doc_id != self._last_doc:
            self.documents += 1
            self._last_doc = doc_id
        if self.buf_tokens >= SHARD_BATCH_TOKENS or len(self.buf_docs) >= SHARD_BATCH_ROWS:
            self._flush()

    def _flush(self) -> None:
        if not self.buf_docs:
            return
        lengths = np.fromiter((len(a) for a in self.buf_ids), dtype=np.int64, count=len(self.buf_ids))
        offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        values = np.concatenate(self.buf_ids).astype(self.dtype, copy=False)
        docs = np.asarray(self.buf_docs, dtype=np.int64)
        ids_arr = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
        batch = pa.RecordBatch.from_arrays([ids_arr, pa.array(docs)], schema=self.schema)
        self.writer.write_batch(batch)
        self.all_lengths.append(lengths)
        self.all_docs.append(docs)
        self.buf_ids, self.buf_docs, self.buf_tokens = [], [], 0

    def close(self, before_rename: Optional[Callable[[dict], None]] = None) -> dict:
        """Finish the files, fsync, checksum, call `before_rename(entry)` (the caller records the files as pending,
        so that they are provably ours once renamed), rename them to their final names; returns the shard's
        manifest entry."""
        self._flush()
        self.writer.close()
        self.sink.close()
        lengths = np.concatenate(self.all_lengths) if self.all_lengths else np.zeros(0, np.int64)
        docs = np.concatenate(self.all_docs) if self.all_docs else np.zeros(0, np.int64)
        tmp_l = self.out / (self.lengths_name + ".tmp")
        tmp_d = self.out / (self.doc_ids_name + ".tmp")
        save_npy(tmp_l, lengths)
        save_npy(tmp_d, docs)
        files = {}
        renames = ((self.tmp, self.arrow_name), (tmp_l, self.lengths_name), (tmp_d, self.doc_ids_name))
        for tmp, final in renames:
            fsync_file(tmp)
            if final == self.arrow_name:
                files[final] = {"bytes": os.path.getsize(tmp), "sha256": sha256_file(tmp)}
            else:  # index files also get a CRC-32, checked on every open (several times faster than sha256)
                data = tmp.read_bytes()
                files[final] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "crc32": crc32(data)}
        entry = {
            "name": self.name,
            "rows": self.rows,
            "tokens": self.tokens,
            "documents": self.documents,
            "first_doc_id": int(docs[0]) if len(docs) else None,
            "last_doc_id": int(docs[-1]) if len(docs) else None,
            "max_length": int(lengths.max()) if len(lengths) else 0,
            "files": files,
        }
        if before_rename is not None:
            before_rename(entry)
        for tmp, final in renames:
            os.replace(tmp, self.out / final)
            note_temporary(tmp, False)
        return entry

    def abort(self) -> None:
        """After a failure: close and remove this shard's temporary files (nothing half-written stays)."""
        try:
            self.writer.close()
            self.sink.close()
        except Exception:  # noqa: BLE001  (closing after a failed write may fail again; the files go anyway)
            pass
        for name in (self.arrow_name, self.lengths_name, self.doc_ids_name):
            try:
                os.remove(self.out / (name + ".tmp"))
            except FileNotFoundError:
                pass
            note_temporary(self.out / (name + ".tmp"), False)


def write_datasets_metadata(
    out: Path,
    shard_names: list[str],
    dtype: np.dtype,
    fingerprint: str,
    features: Any = None,
    description: str = DATASETS_DESCRIPTION,
) -> None:
    """state.json + dataset_info.json so that `datasets.load_from_disk(out)` loads every shard as one Dataset
    (`features`: default a pretokenized shard's)."""
    import datasets

    state: dict[str, object] = {
        "_data_files": [{"filename": f"{n}.arrow"} for n in shard_names],
        "_fingerprint": fingerprint[:16],
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }
    info = dataclasses.asdict(
        datasets.DatasetInfo(
            description=description,
            features=shard_features(dtype) if features is None else features,
        )
    )
    atomic_write_json(out / DATASETS_STATE, state)
    atomic_write_json(out / DATASETS_INFO, {k: info[k] for k in sorted(info)})
