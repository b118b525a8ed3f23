"""Open-time checks of a pretokenized folder: cheap enough to run on every open, strict enough that a reader
never returns wrong data silently.

`open_folder(path)` checks
- the manifest's structure: every field a reader uses is there with the right type, shard names are the sequential
  `shard-00000`, `shard-00001`, ... (so entries cannot be swapped, and no name leaves the folder), each shard names
  exactly its three files, and the per-shard rows and tokens add up to the manifest's counts;
- that every file the manifest names resolves inside the folder (absolute paths, `..` and symlinks out refused)
  and is a regular file of the recorded size;
- the lengths and doc_id index files byte for byte against their recorded CRC-32 (sha256 for folders written before
  the CRC was recorded), and against the manifest and each
  other (rows, tokens, longest row, first/last doc_id, doc_ids in input order, no empty rows);
- each Arrow file's row count, read from its message headers (the token data is not read).
DataError names the file. The full check of every byte is `verify` (balancer.data.shards.verify).
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import stat
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from balancer.data.shards.arrow_rows import ArrowHeaderError, stream_row_count
from balancer.data.shards.errors import DataError
from balancer.data.shards.manifest import MANIFEST_NAME, load_manifest, shard_file_names
from balancer.data.shards.mapped import map_readonly
from balancer.data.shards.sharded import ShardedArray

_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


@dataclass
class OpenedFolder:
    """A checked folder: its manifest and, per shard, the lengths and doc_id index (int64, read-only, memory-mapped).
    `lengths_view()` / `doc_ids_view()` read them as one array without a copy (`ShardedArray`); `lengths()` /
    `doc_ids()` concatenate them (a whole copy)."""

    path: Path
    manifest: dict
    shard_lengths: list[np.ndarray]
    shard_doc_ids: list[np.ndarray]

    def lengths(self) -> np.ndarray:
        return np.concatenate(self.shard_lengths) if self.shard_lengths else np.zeros(0, np.int64)

    def doc_ids(self) -> np.ndarray:
        return np.concatenate(self.shard_doc_ids) if self.shard_doc_ids else np.zeros(0, np.int64)

    def lengths_view(self) -> ShardedArray:
        return self._view(self.shard_lengths, 1)

    def doc_ids_view(self) -> ShardedArray:
        return self._view(self.shard_doc_ids, 2)

    def _view(self, parts: list[np.ndarray], which: int) -> ShardedArray:
        files = []
        for entry, part in zip(self.manifest["shards"], parts):
            name = shard_file_names(entry["name"])[which]
            size = entry["files"][name]["bytes"]  # checked: the file's size; the data ends the .npy
            files.append((str(self.path / name), size - 8 * len(part), len(part)))
        return ShardedArray(parts, files)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _require(ok: bool, where: str, message: str) -> None:
    if not ok:
        raise DataError(f"{where}: {message}")


def check_file_name(folder: Path, name: object, where: str) -> Optional[os.stat_result]:
    """The stat of `folder / name` (None when missing) when `name` is a plain file name whose path stays inside
    `folder`: a symlink is followed and must resolve inside the folder. DataError otherwise."""
    if not (isinstance(name, str) and name not in ("", ".", "..") and not any(c in name for c in "/\\\0")):
        raise DataError(f"{where}: file name {name!r} is not a plain name inside the folder")
    path = folder / name
    try:
        st = os.lstat(path)  # a plain name in the folder: inside it unless it is a symlink
        if stat.S_ISLNK(st.st_mode):
            target = os.path.realpath(path)
            inside = target.startswith(os.path.realpath(folder) + os.sep)
            _require(inside, where, f"{name!r} resolves outside the folder (to {target}); refused")
            st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:  # a symlink loop, ...
        raise DataError(f"{path}: cannot be read ({exc.strerror})") from None
    return st


def check_manifest_structure(folder: Path, m: dict) -> None:
    """Every field a reader relies on, with its type; shard names sequential; counts add up."""
    where = str(folder / MANIFEST_NAME)
    shards, counts = m.get("shards"), m.get("counts")
    if not isinstance(shards, list):
        raise DataError(f"{where}: no 'shards' list (damaged or not written by this tool)")
    if not isinstance(counts, dict):
        raise DataError(f"{where}: no 'counts' object")
    _require(isinstance(m.get("options"), dict), where, "no 'options' object")
    rows = tokens = 0
    for i, entry in enumerate(shards):
        at = f"{where}: shards[{i}]"
        _require(isinstance(entry, dict), at, "not an object")
        _require(entry.get("name") == f"shard-{i:05d}", at, f"name {entry.get('name')!r}, expected 'shard-{i:05d}'")
        for key in ("rows", "tokens"):
            _require(_is_int(entry.get(key)) and entry[key] >= 0, at, f"'{key}' is not a count")
        files = entry.get("files")
        _require(isinstance(files, dict), at, "no 'files' object")
        _require(sorted(files) == sorted(shard_file_names(entry["name"])), at, f"names files {sorted(files)}")
        for fn, meta in files.items():
            ok = isinstance(meta, dict) and _is_int(meta.get("bytes")) and meta["bytes"] >= 0
            _require(ok and isinstance(meta.get("sha256"), str), at, f"files[{fn!r}] lacks bytes/sha256")
            _require(bool(_SHA256_RE.match(meta["sha256"])), at, f"files[{fn!r}].sha256 is not a sha256")
            crc = meta.get("crc32", 0)
            _require(_is_int(crc) and 0 <= crc < 1 << 32, at, f"files[{fn!r}].crc32 is not a CRC-32")
        rows += entry["rows"]
        tokens += entry["tokens"]
    for key, total in (("rows", rows), ("tokens", tokens)):
        _require(
            counts.get(key) == total, where, f"counts.{key} = {counts.get(key)!r} but the shards hold {total} {key}"
        )


def check_files_inside(folder: Path, entry: dict, record: str = MANIFEST_NAME) -> None:
    """Each file of the shard `entry` (of the manifest or state file `record`) is a regular file inside `folder`
    of the recorded size."""
    for fn, meta in entry["files"].items():
        st = check_file_name(folder, fn, str(folder / record))
        if st is None or not stat.S_ISREG(st.st_mode):
            raise DataError(f"{folder / fn}: missing (or not a regular file)")
        size = st.st_size
        _require(size == meta["bytes"], str(folder / fn), f"size {size} != {meta['bytes']} recorded in the manifest")


_NPY_HEAD = (1 << 16) + 16  # a version 1.0 .npy header is at most this long (2.0 ones written here are too)


def _npy_view(data) -> np.ndarray:
    """The array in .npy bytes (or a memory map of them), without copying them (np.load would)."""
    stream = io.BytesIO(data[:_NPY_HEAD])
    version = np.lib.format.read_magic(stream)
    if version not in ((1, 0), (2, 0)):
        return np.load(io.BytesIO(data), allow_pickle=False)
    read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, fortran, dtype = read_header(stream)
    count = int(np.prod(shape))
    arr = np.frombuffer(data, dtype=dtype, count=count, offset=stream.tell())
    return arr.reshape(shape, order="F" if fortran else "C")


def _map_bytes(path: Path):
    """The file's bytes, memory-mapped read-only (empty for an empty file), holding no file descriptor."""
    return map_readonly(path)


def _load_index(path: Path, meta: dict, rows: int) -> np.ndarray:
    """The checked index file as a read-only array over its memory map: nothing of it is copied into memory."""
    try:
        data = _map_bytes(path)
    except OSError as exc:
        raise DataError(f"{path}: cannot be read ({exc.strerror})") from None
    if "crc32" in meta:  # written since the CRC was added: the cheap check
        ok, kind = (zlib.crc32(data) & 0xFFFFFFFF) == meta["crc32"], "crc32"
    else:
        ok, kind = hashlib.sha256(data).hexdigest() == meta["sha256"], "sha256"
    _require(ok, str(path), f"checksum ({kind}) mismatch: the index file changed or is corrupted")
    try:
        arr = _npy_view(data)
    except Exception as exc:  # noqa: BLE001
        raise DataError(f"{path}: not a readable .npy index ({exc})") from None
    _require(
        arr.dtype == np.int64 and arr.shape == (rows,),
        str(path),
        f"holds {arr.dtype}{list(arr.shape)}, expected int64[{rows}]",
    )
    return arr


def check_shard_index(
    folder: Path, entry: dict, prev_last_doc: int, record: str = MANIFEST_NAME
) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, doc_ids) of the shard `entry` of the manifest or state file `record`, checked against the entry:
    checksums, rows, tokens, longest row, first/last doc_id, input order after `prev_last_doc`, Arrow row count."""
    arrow, lfile, dfile = shard_file_names(entry["name"])
    lengths = _load_index(folder / lfile, entry["files"][lfile], entry["rows"])
    doc_ids = _load_index(folder / dfile, entry["files"][dfile], entry["rows"])
    where = f"{folder / record}: {entry['name']}"
    total = int(lengths.sum())
    _require(total == entry["tokens"], where, f"{lfile} sums to {total} tokens, {record} says {entry['tokens']}")
    if len(lengths):
        _require(int(lengths.min()) >= 1, str(folder / lfile), "holds an empty row")
        longest = int(lengths.max())
        recorded = entry.get("max_length", longest)
        _require(recorded == longest, where, f"max_length {recorded} but {lfile} holds a row of {longest}")
        in_order = doc_ids[0] >= prev_last_doc and not np.any(doc_ids[1:] < doc_ids[:-1])
        _require(bool(in_order), str(folder / dfile), "doc_ids out of input order")
        ends = (entry.get("first_doc_id"), entry.get("last_doc_id"))
        _require(ends == (int(doc_ids[0]), int(doc_ids[-1])), where, f"first/last doc_id {ends} disagree with {dfile}")
    try:
        arrow_rows = stream_row_count(folder / arrow)
    except ArrowHeaderError as exc:
        raise DataError(str(exc)) from None
    _require(arrow_rows == entry["rows"], str(folder / arrow), f"{arrow_rows} rows, {record} says {entry['rows']}")
    return lengths, doc_ids


def open_folder(path: str | os.PathLike) -> OpenedFolder:
    """The checked manifest and index of a finished folder (see the module docstring); DataError naming the file
    and what is wrong otherwise."""
    folder = Path(path)
    m = load_manifest(folder)
    check_manifest_structure(folder, m)
    all_lengths: list[np.ndarray] = []
    all_doc_ids: list[np.ndarray] = []
    last_doc = -1
    for entry in m["shards"]:
        check_files_inside(folder, entry)
        lengths, doc_ids = check_shard_index(folder, entry, last_doc)
        if len(doc_ids):
            last_doc = int(doc_ids[-1])
        all_lengths.append(lengths)
        all_doc_ids.append(doc_ids)
    return OpenedFolder(folder, m, all_lengths, all_doc_ids)
