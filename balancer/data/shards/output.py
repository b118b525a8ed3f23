"""The output folder of `pretokenize` and `merge`: which files are provably ours, whether a folder may be written
(fresh, resumed, already complete, or refused), and the lock that keeps two writers apart.

Ownership: a file is ours only when this tool's manifest or state file in the folder names it (shard files), when
its content is what this tool writes (`state.json`, `dataset_info.json`, the lock), or when it is a temporary or
shard file of a job whose manifest or state is in the folder (left by a killed run). `--overwrite` deletes only
those; any other file is the user's and is never deleted (a user file with one of our names is refused). The
rules take an `OutputKind`, the names one command writes (`PRETOKENIZE`, the default, or `pack`'s).
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from balancer.data.shards.errors import DataError
from balancer.data.shards.manifest import FORMAT_NAME, MANIFEST_NAME, STATE_NAME, load_json_file

LOCK_NAME = ".balancer.lock"
DATASETS_STATE = "state.json"
DATASETS_INFO = "dataset_info.json"
DATASETS_DESCRIPTION = "balancer pretokenize output: input_ids per row, doc_id = source record index"
_SHARD_FILE_RE = re.compile(r"^shard-\d{5,}\.(arrow|lengths\.npy|doc_ids\.npy)$")


@dataclass(frozen=True)
class OutputKind:
    """What one command writes into its output folders, for the ownership rules: `format_name` (the manifest's
    "format"), `state_name` (its progress file), `file_re` (the data files its manifest and state name, in the
    lists `record_lists`), `description` (its dataset_info.json's)."""

    command: str
    format_name: str
    state_name: str
    file_re: re.Pattern
    description: str
    record_lists: tuple[str, ...] = ("shards",)

    @property
    def fixed_names(self) -> tuple[str, ...]:
        return (MANIFEST_NAME, self.state_name, DATASETS_STATE, DATASETS_INFO)


PRETOKENIZE = OutputKind("pretokenize", FORMAT_NAME, STATE_NAME, _SHARD_FILE_RE, DATASETS_DESCRIPTION)


def is_output_name(name: str, kind: OutputKind = PRETOKENIZE) -> bool:
    """True for a name this tool may write into an output folder (final or temporary)."""
    base = name[: -len(".tmp")] if name.endswith(".tmp") else name
    return base in kind.fixed_names or bool(kind.file_re.match(base))


def _our_job_record(path: Path, kind: OutputKind) -> Optional[dict]:
    """The manifest or state file at `path` when this tool wrote it, else None."""
    data = load_json_file(path)
    if not isinstance(data, dict) or "job" not in data:
        return None
    if not all(isinstance(data.get(key), list) for key in kind.record_lists):
        return None
    if path.name == MANIFEST_NAME and data.get("format") != kind.format_name:
        return None
    return data


def _named_files(record: dict, kind: OutputKind) -> set[str]:
    names = set()
    for entry in (e for key in kind.record_lists for e in record[key]):
        files = entry.get("files") if isinstance(entry, dict) else None
        if isinstance(files, dict):
            names.update(n for n in files if isinstance(n, str) and kind.file_re.match(n))
    return names


def _is_our_metadata(path: Path, kind: OutputKind) -> bool:
    data = load_json_file(path)
    if not isinstance(data, dict):
        return False
    if path.name == DATASETS_STATE:
        files = data.get("_data_files")
        return isinstance(files, list) and all(
            isinstance(f, dict) and kind.file_re.match(str(f.get("filename", ""))) for f in files
        )
    return data.get("description") == kind.description


def owned_files(out: Path, kind: OutputKind = PRETOKENIZE) -> set[str]:
    """Names in `out` this tool provably wrote (see the module docstring)."""
    entries = set(os.listdir(out))
    names = (MANIFEST_NAME, kind.state_name)
    records = [r for r in (_our_job_record(out / n, kind) for n in names) if r]
    owned = {n for n in names if n in entries and _our_job_record(out / n, kind)}
    owned |= {n for n in (DATASETS_STATE, DATASETS_INFO) if n in entries and _is_our_metadata(out / n, kind)}
    if kind.state_name + ".tmp" in entries:  # a hidden name of ours: a run killed before its first state rename
        owned.add(kind.state_name + ".tmp")
    for record in records:
        owned |= _named_files(record, kind) & entries
    if records:  # leftovers of a killed run of this job: data files not yet recorded, temporary files
        owned |= {n for n in entries if is_output_name(n, kind)}
    return owned


def clear_outputs(out: Path, keep: Iterable[str] = (), kind: OutputKind = PRETOKENIZE) -> None:
    """Remove the files we own in `out` except `keep`; the manifest and state file last, so that a kill midway
    leaves the proof of ownership of whatever is still there."""
    keep = set(keep)
    doomed = owned_files(out, kind) - keep
    proofs = [n for n in (kind.state_name, MANIFEST_NAME) if n in doomed]
    for name in sorted(doomed - set(proofs)) + proofs:
        try:
            os.remove(out / name)
        except FileNotFoundError:
            pass


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def check_output_vs_inputs(out: Path, inputs: Sequence[str]) -> None:
    """Refuse an output folder that is, contains, or is inside an input (file or folder)."""
    real_out = os.path.realpath(out)
    for spec in inputs:
        if not os.path.exists(spec):
            continue  # a hub dataset name
        real_in = os.path.realpath(spec)
        if real_in == real_out:
            raise DataError(f"--output {out} is the input {spec}; write to another folder")
        if _inside(real_in, real_out):
            raise DataError(f"--output {out} contains the input {spec}; write to a folder outside it")
        if _inside(real_out, real_in):
            raise DataError(f"--output {out} is inside the input {spec}; write to a folder outside it")


def prepare_output(
    out: Path, job: str, slice_: Optional[dict], overwrite: bool, kind: OutputKind = PRETOKENIZE
) -> tuple[str, Optional[dict]]:
    """('fresh'|'resume'|'complete', state or manifest). Refuses a folder holding something else; with
    `overwrite`, deletes only our files and refuses user files that carry one of our names."""
    owned = owned_files(out, kind)
    foreign = sorted(set(os.listdir(out)) - owned - {LOCK_NAME})
    if not foreign and owned <= {kind.state_name + ".tmp"}:  # empty, or killed before the first state rename
        clear_outputs(out, kind=kind)
        return "fresh", None
    manifest = _our_job_record(out / MANIFEST_NAME, kind)
    state = _our_job_record(out / kind.state_name, kind)
    if not overwrite:
        if manifest is not None and manifest.get("job") == job and manifest.get("slice") == slice_:
            return "complete", manifest
        if manifest is None and state is not None and state.get("job") == job and state.get("slice") == slice_:
            return "resume", state
        if manifest is not None or state is not None:
            raise DataError(
                f"--output {out} holds a different job of `balancer {kind.command}` (other inputs or options); "
                f"pass --overwrite to replace it"
            )
        raise DataError(
            f"--output {out} is not empty and holds no {kind.command} job "
            f"({len(foreign)} entries, e.g. {foreign[0]!r}); pass --overwrite to use it"
        )
    clashing = [n for n in foreign if is_output_name(n, kind)]
    if clashing:
        raise DataError(
            f"--output {out}: {clashing[0]!r} has a name this tool writes but was not written by it "
            f"(no manifest or state of ours names it); move it away, --overwrite never deletes your files"
        )
    clear_outputs(out, kind=kind)
    return "fresh", None


# ----------------------------------------------------------------------------------------------------------------
# the lock


def _lock_owner(path: Path) -> str:
    data = load_json_file(path) or {}
    return f"pid {data.get('pid', '?')} on host {data.get('host', '?')} since {data.get('started', '?')}"


class OutputLock:
    """An exclusive lock on an output folder, held while a run writes it: `DIR/.balancer.lock` names the owner
    (pid, host, start time) and carries an advisory `flock`, which the kernel drops when the owner dies (also on
    kill -9). A lock file left by a dead run is therefore taken over silently; one held by a live run makes the
    second run fail naming the file and its owner."""

    def __init__(self, out: Path) -> None:
        self.path = out / LOCK_NAME
        self.fd: Optional[int] = None

    def __enter__(self) -> OutputLock:
        import fcntl

        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise DataError(
                    f"{self.path}: the folder is being written by another run ({_lock_owner(self.path)}); wait for "
                    f"it to finish, or stop it; if no such process is running, delete {self.path} and run again"
                ) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:  # else the previous holder removed the file after we opened it: take the new one
                break
            os.close(fd)
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(owner) + "\n").encode(), 0)
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is None:
            return
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass
        os.close(self.fd)
        self.fd = None


def open_output(out: Path, inputs: Sequence[str]) -> OutputLock:
    """Create `out` (refusing a non-folder, or a folder that is, holds or lies in an input) and return its lock
    (use as a context manager)."""
    check_output_vs_inputs(out, inputs)
    if out.exists() and not out.is_dir():
        raise DataError(f"--output {out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    return OutputLock(out)
