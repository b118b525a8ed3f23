"""The on-disk format of a pretokenized folder: names, the manifest, and small crash-safe file helpers.

`load_manifest` reads `manifest.json`; `shard_file_names` gives a shard's three files; `verify_shard_files` checks
one shard's files against the sizes and sha256 recorded for them; `atomic_write_json` writes a JSON file so that
readers see the old or the new version, never half of one.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from pathlib import Path
from typing import Any, Optional

import numpy as np

from balancer.data.shards.errors import DataError
from balancer.temporaries import note_temporary

FORMAT_NAME = "balancer-pretokenized"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
STATE_NAME = ".pretokenize-state.json"


def sha256_file(path: Path, chunk: int = 1 << 23) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                return h.hexdigest()
            h.update(b)


def shard_file_names(name: str) -> tuple[str, str, str]:
    """(Arrow data, lengths index, doc_id index) file names of shard `name`."""
    return f"{name}.arrow", f"{name}.lengths.npy", f"{name}.doc_ids.npy"


def load_manifest(path: str | os.PathLike) -> dict:
    """The manifest of a finished output folder; DataError when there is none (unfinished or not ours)."""
    from balancer.data.shards.schema import load_record

    p = Path(path) / MANIFEST_NAME
    if not p.is_file():
        raise DataError(f"{path}: no {MANIFEST_NAME} (not a finished `balancer pretokenize` output)")
    return load_record(p, "manifest")  # strict: exact types, no unknown keys, known format_version


def load_json_file(path: Path) -> Optional[dict]:
    """The JSON object in `path`, or None when it is missing, not valid JSON, or not an object."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def verify_shard_files(out: Path, entry: dict) -> Optional[str]:
    """None when the shard's files exist and match their recorded sizes and checksums, else the problem."""
    for fn, meta in entry["files"].items():
        p = out / fn
        if not p.is_file():
            return f"{p}: missing"
        if os.path.getsize(p) != meta["bytes"]:
            return f"{p}: size {os.path.getsize(p)} != {meta['bytes']} in the manifest"
        if sha256_file(p) != meta["sha256"]:
            return f"{p}: sha256 mismatch (file changed or corrupted)"
        if "crc32" in meta and zlib.crc32(p.read_bytes()) & 0xFFFFFFFF != meta["crc32"]:  # index files only: small
            return f"{p}: crc32 mismatch with the manifest (the manifest was edited?)"
    return None


# ----------------------------------------------------------------------------------------------------------------
# crash-safe writes


def fsync_file(path: Path) -> None:
    """Flush a finished file's bytes to disk (before it is renamed to its final name)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def create_new_file(path: Path) -> int:
    """A write descriptor of a file created at `path`, which must not exist: never opened through a symlink (a
    link or any other entry already there fails with FileExistsError naming it), so no write leaves the folder."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)


def remove_if_present(path: Path) -> None:
    """Remove the directory entry `path` (a link itself, never its target) when it exists."""
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def atomic_write_json(path: Path, obj: Any) -> None:
    """Write `obj` as JSON to `path` via a temporary file (created new, never through a symlink), fsync and
    rename: readers see old or new, never half."""
    tmp = path.with_name(path.name + ".tmp")
    new = note_temporary(tmp, True)  # recorded before it exists: a kill's leftover is deleted by the record only
    try:
        with os.fdopen(create_new_file(tmp), "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, sort_keys=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        note_temporary(tmp, False)
    except FileExistsError:  # not ours (the output rules delete only recorded leftovers): never removed
        if new:
            note_temporary(tmp, False)
        raise
    except BaseException:  # disk full, interrupted: leave the old file, not half of a new one
        remove_if_present(tmp)
        note_temporary(tmp, False)
        raise


def save_npy(path: Path, arr: np.ndarray) -> None:
    """An int64 index file (.npy, no pickles)."""
    with os.fdopen(create_new_file(path), "wb") as f:
        np.save(f, np.ascontiguousarray(arr, dtype=np.int64), allow_pickle=False)
