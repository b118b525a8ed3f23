"""The run state's journal: what a run of pretokenize, merge or pack records as it goes, appended instead of
rewriting the state.

The state file (`.pretokenize-state.json`, `.pack-state.json`) is written whole at the start of a run (holding
everything finished before; once more when the run stops, the journal folded in) and names its journal by a random
`journal` id; each finished file then appends two lines to the journal (the state's name + `.journal`): `{"pending":
[...]}` before its renames (its files, checksummed) and `{"shard": entry}` (pack's epoch plans: `{"plan": entry}`)
after them. So a record costs O(1), not a rewrite of everything before it (quadratic in the shards). A line is
`<crc32 of the JSON, 8 hex digits> <JSON>\\n`, written in one `write` and fsynced before the run goes on. The state
of the run is the state file with its journal's lines applied in order (`replay`): a kill at any moment leaves the
old state or the new one, because a line that did not reach its newline (or whose checksum fails) as the *last* line
is a record that was never committed, and the run did nothing that needed it; a bad line before the last is damage,
refused naming the file and line. A journal whose header names another id is a stale one of an earlier run (the
state was rewritten, holding its records, before it was removed) and is ignored. `JournaledState` is one run's side
of this (pretokenize, merge and pack), `load_state` the resuming run's.
"""

from __future__ import annotations

import json
import os
import secrets
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from balancer.data.shards.errors import DataError, arg
from balancer.data.shards.manifest import atomic_write_json, create_new_file
from balancer.data.shards.schema import check_record, load_record

JOURNAL_SUFFIX = ".journal"
_HEADER_KEY = "journal"
_LISTS = {"shard": "shards", "plan": "plans"}  # a record's key -> the list of the state it adds to


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
        self.fd: Optional[int] = create_new_file(self.path)
        self._write({_HEADER_KEY: ident})

    def _write(self, record: dict) -> None:
        if self.fd is None:
            raise ValueError(f"{self.path}: the journal is closed")
        data = _line(record)
        if os.write(self.fd, data) != len(data):
            raise OSError(f"{self.path}: short write")
        os.fsync(self.fd)

    def append(self, record: dict) -> None:
        """Append one record (`{"pending": [...]}`, `{"shard": entry}` or `{"plan": entry}`), fsynced before it
        returns."""
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


def _shape(state: dict, record: dict) -> Optional[str]:
    """The key of `record` when `state` can take it: "pending" (a list), "shard" or "plan" (an entry, where the
    state has `shards` or `plans`); else None."""
    if len(record) != 1:
        return None
    ((key, value),) = record.items()
    if key == "pending":
        return key if isinstance(value, list) else None
    return key if isinstance(value, dict) and isinstance(state.get(_LISTS.get(key, "")), list) else None


def remove_state(state_path: Path, is_ours: Callable[[Path], bool] = os.path.lexists) -> None:
    """Remove a run's state file (when `is_ours(state_path)`) and its journal (when ours): by default the state of the
    run that has just written its manifest; with an ownership check, the ones a run killed between writing its
    manifest and removing them left beside a finished output."""
    if is_ours(state_path):
        os.remove(state_path)
    remove_our_journal(state_path)


def apply_record(state: dict, record: dict) -> bool:
    """Apply one journal record to `state` in place: a pending record replaces `pending`; a shard (plan) record
    appends its entry to `shards` (`plans`) and clears `pending`. False, `state` untouched, for a record of another
    shape or one whose list `state` lacks."""
    key = _shape(state, record)
    if key == "pending":
        state["pending"] = record[key]
    elif key is not None:
        state[_LISTS[key]].append(record[key])
        state.pop("pending", None)
    return key is not None


def replay(state: dict, records: list[dict], file: str) -> dict:
    """`state` (not changed) with the journal's `records` applied in order (`apply_record`). DataError naming
    `file` for a record of another shape."""
    state = dict(state, **{k: list(state[k]) for k in _LISTS.values() if isinstance(state.get(k), list)})
    for i, record in enumerate(records):
        if not apply_record(state, record):
            raise DataError(f"{file}: record {i + 2} is not a pending, shard or plan record of this state")
    return state


def load_state(state_path: Path, kind: str) -> dict:
    """The run state at `state_path` a resumed run continues from: the state file with its journal's committed
    records applied, read strictly (`schema.load_record` of `kind`, before and after); DataError naming the file."""
    state = load_record(state_path, kind)
    records = read_journal(state_path, state.get("journal"))
    return check_record(replay(state, records, str(journal_path(state_path))), str(state_path), kind)


class JournaledState:
    """One run's state (`state`, a dict it keeps current) in the state file at `path` and its journal: written whole
    at the start (`__init__`), one journal line per `record`, folded in once more when the run stops (`compact`)."""

    def __init__(self, path: Path, state: dict) -> None:
        """Write `state` (everything the run keeps from before) whole under a new journal id and start the
        journal; a kill in between leaves the state, whose id makes any journal there a stale one."""
        self.path, self.state = path, state
        state["journal"] = secrets.token_hex(8)
        atomic_write_json(path, state)
        self.journal = StateJournal(path, state["journal"])

    def record(self, record: dict) -> None:
        """Append `record` to the journal (fsynced), then apply it to `state` (`apply_record`)."""
        if _shape(self.state, record) is None:
            raise ValueError(f"not a record of this state: {sorted(record)}")
        self.journal.append(record)
        apply_record(self.state, record)

    def compact(self) -> None:
        """Fold the journal into the state file (one whole write) and remove it: a run that stops by itself,
        finished or not, leaves one self-contained state. A kill in between leaves a state without a journal id,
        which makes the journal a stale one of ours."""
        self.journal.close()
        self.state.pop("journal", None)
        atomic_write_json(self.path, self.state)
        remove_our_journal(self.path)

    def abort(self) -> None:
        """`compact` where it can: without space for the state, the journal stays, as valid as before."""
        try:
            self.compact()
        except OSError:
            pass

    def discard(self) -> None:
        """Remove the state file and its journal (a run that leaves no trace)."""
        self.journal.close()
        os.remove(self.path)
        remove_our_journal(self.path)
