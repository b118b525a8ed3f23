"""What a resumed `pretokenize` run checks before it trusts its state file, and the inputs against change.

`check_state_against_disk`: the state's shard list is sequential, every recorded file is on disk at its recorded
size and checksum (the ownership rules checked the sha256), each shard's index agrees with its entry, and the
cursors and counters agree with the shards (a state whose cursor or shard list was edited, or whose shard files
were swapped, is refused naming the file and the disagreement). `InputWatch`: the inputs as they were hashed at
the start of this run (size, modification time, inode), checked when a record fails and once more, with a second
sha256 of every input, before the manifest calls the output complete. `refuse_merge_state`: a state that
`balancer merge` left in the folder is named as such.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from balancer.data.shards.checks import check_files_inside, check_shard_index
from balancer.data.shards.errors import DataError, arg
from balancer.data.shards.journal import read_journal
from balancer.data.shards.manifest import STATE_NAME


def _refuse(out: Path, message: str) -> DataError:
    return DataError(
        f"{out / STATE_NAME}: {message}; the state disagrees with the shards on disk, so this run does not resume "
        f"from it: pass {arg('overwrite', True)} to start over"
    )


def check_state_against_disk(out: Path, state: dict, start_record: int) -> None:
    """Refuse (DataError naming the state file and the disagreement) a state whose shards, cursors or counters
    disagree with each other or with the files on disk; `start_record` is this run's first record."""
    record = STATE_NAME
    last_doc, prev_record, prev_rows, prev_tokens = -1, start_record, 0, 0
    for i, entry in enumerate(state["shards"]):
        name = f"shard-{i:05d}"
        if entry["name"] != name:
            raise _refuse(out, f"shards[{i}] is {entry['name']!r}, expected {name!r} (entries dropped or swapped)")
        try:
            check_files_inside(out, entry, record)
            _, doc_ids = check_shard_index(out, entry, last_doc, record)
        except DataError as exc:
            raise _refuse(out, f"{name}: {exc}") from None
        cursor, counters = entry["cursor"], entry["counters"]
        if len(doc_ids):
            last_doc = int(doc_ids[-1])
        if len(doc_ids) and int(doc_ids[0]) < prev_record:
            raise _refuse(out, f"{name} starts at doc_id {int(doc_ids[0])}, before the previous cursor {prev_record}")
        if cursor["record"] <= last_doc or cursor["record"] < prev_record:
            raise _refuse(out, f"{name}: cursor at record {cursor['record']}, but the shard holds doc_id {last_doc}")
        if cursor["record"] - start_record != counters["records"]:
            raise _refuse(
                out,
                f"{name}: cursor at record {cursor['record']} but {counters['records']} records counted from "
                f"record {start_record}",
            )
        if (counters["rows"], counters["tokens"]) != (prev_rows + entry["rows"], prev_tokens + entry["tokens"]):
            raise _refuse(out, f"{name}: its counters disagree with the rows and tokens of the shards up to it")
        prev_record, prev_rows, prev_tokens = cursor["record"], counters["rows"], counters["tokens"]


def describe_input_change(previous: Optional[list], now: list[dict]) -> Optional[str]:
    """How the inputs recorded by an earlier run differ from the ones hashed now (None: no record, or no change)."""
    if not isinstance(previous, list):
        return None
    if [p.get("path") for p in previous if isinstance(p, dict)] != [n["path"] for n in now]:
        return "the list of inputs changed since the interrupted run"
    for old, new in zip(previous, now):
        if old.get("sha256") == new["sha256"]:
            continue
        size_old, size_new = old.get("size"), new["size"]
        how = "truncated" if size_new < size_old else "grown" if size_new > size_old else "edited (same size)"
        return f"input {new['path']} changed since the interrupted run: {how} ({size_old} -> {size_new} bytes)"
    return None


def _stat_key(path: str) -> Optional[tuple]:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns, st.st_ino


class InputWatch:
    """The file inputs' size, modification time and inode as this run first saw them."""

    def __init__(self, sources: list) -> None:
        self.keys = {s.path: _stat_key(s.path) for s in sources if s.kind not in ("hf_disk", "hf_hub")}

    def changed(self) -> Optional[str]:
        """The first input whose size, modification time or inode changed since the start (None: none)."""
        for path, key in self.keys.items():
            now = _stat_key(path)
            if now != key:
                if now is None:
                    size = "gone"
                elif key is None:  # missing at the start, there now
                    size = f"appeared, {now[0]} bytes"
                else:
                    size = f"{key[0]} -> {now[0]} bytes"
                return f"input {path} changed while this run read it ({size})"
        return None

    def error(self, change: str) -> DataError:
        return DataError(
            f"{change}: the output is not complete and no manifest was written; run again once the input is stable "
            f"(a changed input is a new job: pass {arg('overwrite', True)})"
        )


def refuse_merge_state(path: Path) -> None:
    """A state that `balancer merge` left (its shards carry no input cursor): say so, rather than name a key."""
    try:
        state = json.loads(path.read_text())
        shards = list(state.get("shards", []))
        shards += [r["shard"] for r in read_journal(path, state.get("journal")) if "shard" in r]
    except (OSError, ValueError, TypeError, AttributeError, KeyError, DataError):
        return
    if state.get("slice") is None and any(isinstance(e, dict) and "cursor" not in e for e in shards):
        raise DataError(
            f"{path}: the state of an unfinished `balancer merge` into this folder, not of pretokenize: run that merge "
            f"again to finish it, or pass {arg('overwrite', True)} to pretokenize into the folder anew"
        )
