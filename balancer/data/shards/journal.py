"""The run state's journal: what a pretokenize run records per shard, appended instead of rewriting the state.

The state file (`.pretokenize-state.json`) is written whole once per run (at its start, holding every shard finished
before) and names its journal by a random `journal` id; each shard then appends two lines to the journal
(`.pretokenize-state.json.journal`): `{"pending": [...]}` before the shard's renames (its files, checksummed) and
`{"shard": entry}` after them. So a shard's record costs O(1), not a rewrite of every shard before it (quadratic in
the shards). A line is `<crc32 of the JSON, 8 hex digits> <JSON>\\n`, written in one `write` and fsynced before the
run goes on. The state of the run is the state file with its journal's lines applied in order (`replay`): a kill at
any moment leaves the old state or the new one, because a line that did not reach its newline (or whose checksum
fails) as the *last* line is a record that was never committed, and the run did nothing that needed it; a bad line
before the last is damage, refused naming the file and line. A journal whose header names another id is a stale one
of an earlier run (the state was rewritten, holding its records, before it was removed) and is ignored.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Optional

from balancer.data.shards.errors import DataError, arg
from balancer.data.shards.manifest import create_new_file

JOURNAL_SUFFIX = ".journal"
_HEADER_KEY = "journal"


def journal_path(state_path: Path) -> Path:
    """The journal beside the state file `state_path`."""
    return state_path.with_name(state_path.name + JOURNAL_SUFFIX)


def _line(record: dict) -> bytes:
    body = json.dumps(record, separators=(",", ":"), allow_nan=False).encode()
    return b"%08x %s\n" % (zlib.crc32(body), body)


class StateJournal:
    """The journal of one run, appended to (`append`) while the run holds its folder's lock."""

    def __init__(self, state_path: Path, ident: str) -> None:
        """Start a new journal with header `ident` (a stale one there is removed first: the caller's state file,
        already rewritten with a new id, holds every record it had)."""
        self.path = journal_path(state_path)
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass
        self.fd = create_new_file(self.path)
        self._write({_HEADER_KEY: ident})

    def _write(self, record: dict) -> None:
        data = _line(record)
        if os.write(self.fd, data) != len(data):
            raise OSError(f"{self.path}: short write")
        os.fsync(self.fd)

    def append(self, record: dict) -> None:
        """Append one record (`{"pending": [...]}` or `{"shard": entry}`), fsynced before it returns."""
        self._write(record)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def read_journal(state_path: Path, ident: Optional[str]) -> list[dict]:
    """The committed records of the journal of the state whose `journal` id is `ident` ([] when there is none, or
    the journal there is a stale one of another id); DataError naming the file and line for damage."""
    path = journal_path(state_path)
    if ident is None or not os.path.lexists(path):
        return []
    if os.path.islink(path) or not path.is_file():
        raise DataError(f"{path}: not a journal of this tool (not a regular file); move it away")
    *complete, _torn = path.read_bytes().split(b"\n")  # after the last newline: an append a kill cut short, if any
    records = []
    for i, raw in enumerate(complete):
        record = _parse(raw)
        if record is None:
            raise DataError(
                f"{path}: line {i + 1} is damaged (its checksum or JSON fails); the run state cannot be trusted: "
                f"move the folder away or pass {arg('overwrite', True)}"
            )
        records.append(record)
    if not records or set(records[0]) != {_HEADER_KEY}:
        raise DataError(f"{path}: not a journal of this tool (no header line); move it away")
    if records[0][_HEADER_KEY] != ident:
        return []  # a stale journal of an earlier run
    return records[1:]


def _parse(raw: bytes) -> Optional[dict]:
    crc, _, body = raw.partition(b" ")
    try:
        if len(crc) != 8 or int(crc, 16) != zlib.crc32(body):
            return None
        record = json.loads(body)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def is_our_journal(path: Path) -> bool:
    """Whether `path` is a regular file whose first line is a journal header of this tool."""
    if os.path.islink(path) or not path.is_file():
        return False
    with open(path, "rb") as f:
        first = f.readline(4096)
    record = _parse(first.rstrip(b"\n")) if first.endswith(b"\n") else None
    return record is not None and set(record) == {_HEADER_KEY} and isinstance(record[_HEADER_KEY], str)


def remove_our_journal(state_path: Path) -> None:
    """Remove the journal beside `state_path` when it is ours (the run is complete: the manifest holds everything)."""
    path = journal_path(state_path)
    if is_our_journal(path):
        os.remove(path)


def replay(state: dict, records: list[dict], file: str) -> dict:
    """`state` with the journal's `records` applied in order: a pending record replaces `pending`, a shard record
    appends the shard and clears `pending`. DataError naming `file` for a record of another shape."""
    state = dict(state, shards=list(state["shards"]))
    for i, record in enumerate(records):
        if set(record) == {"pending"} and isinstance(record["pending"], list):
            state["pending"] = record["pending"]
        elif set(record) == {"shard"} and isinstance(record["shard"], dict):
            state["shards"].append(record["shard"])
            state.pop("pending", None)
        else:
            raise DataError(f"{file}: record {i + 2} is not a pending or shard record")
    return state
