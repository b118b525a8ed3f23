"""The output folder of `pretokenize`, `merge` and `pack`: which files are provably ours, whether a folder may be
written (fresh, resumed, already complete, or refused), the lock that keeps two writers apart, and
`refuse_overwrite_of_inputs`, the guard every command that writes runs against its inputs.

Ownership (`ownership`): a file is ours only when it is a regular file (never a symlink) and
- it is our manifest or state file (its content says so: our `format`, a `job`, the record lists);
- its content is what this tool writes (`state.json`: only our shard names; `dataset_info.json`: our description);
- a manifest or state of ours in the folder records it and its size and sha256 still match the record;
- it is a temporary (`.tmp`) file of our names that the folder's lock records: a run records every temporary name
  in its lock file before it creates the file (`balancer.temporaries.note_temporary`) and drops it once the file is
  renamed or removed, so a run killed in between leaves the name recorded, and the next run, taking the lock over,
  deletes exactly those files (a temporary name is never enough);
- it is a data file the state of the unfinished run records as `pending` (checksummed before its rename; the run was
  killed before recording it as finished) whose size and sha256 match.
Any other file carrying one of our names is *disputed*: every run (plain, resume, `--overwrite`) stops naming it and
its reason, and nothing is deleted. `--overwrite` deletes only owned files; files with other names are never touched.
The rules take an `OutputKind`, the names one command writes (`PRETOKENIZE`, the default, or `pack`'s).
"""

from __future__ import annotations

import errno
import json
import os
import re
import socket
import stat
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from balancer.data.shards.errors import DataError, arg
from balancer.data.shards.journal import JOURNAL_SUFFIX, is_our_journal, journal_path, read_journal, replay
from balancer.data.shards.manifest import FORMAT_NAME, MANIFEST_NAME, STATE_NAME, load_json_file, sha256_file
from balancer.paths import input_clash
from balancer.temporaries import note_temporary, record_temporaries

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
        return (MANIFEST_NAME, self.state_name, self.state_name + JOURNAL_SUFFIX, DATASETS_STATE, DATASETS_INFO)


PRETOKENIZE = OutputKind("pretokenize", FORMAT_NAME, STATE_NAME, _SHARD_FILE_RE, DATASETS_DESCRIPTION)


def is_output_name(name: str, kind: OutputKind = PRETOKENIZE) -> bool:
    """True for a name this tool may write into an output folder (final or temporary)."""
    base = name[: -len(".tmp")] if name.endswith(".tmp") else name
    return base in kind.fixed_names or bool(kind.file_re.match(base))


def is_regular_file(path: Path) -> bool:
    """A regular file itself (a symlink, even to a regular file, is not)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _our_job_record(path: Path, kind: OutputKind) -> Optional[dict]:
    """The manifest or state file at `path` when this tool wrote it (a regular file), else None."""
    if not is_regular_file(path):
        return None
    data = load_json_file(path)
    if not isinstance(data, dict) or not isinstance(data.get("job"), str):
        return None
    if not all(isinstance(data.get(key), list) for key in kind.record_lists):
        return None
    if path.name == MANIFEST_NAME and data.get("format") != kind.format_name:
        return None
    return data


def is_our_record(path: Path, kind: OutputKind = PRETOKENIZE) -> bool:
    """Whether `path` is a manifest or state file this tool wrote (a regular file with our record's shape)."""
    return _our_job_record(path, kind) is not None


def _recorded_files(record: dict, kind: OutputKind) -> dict[str, dict]:
    """name -> {bytes, sha256} of every data file `record` (a manifest or state) names."""
    named = {}
    for entry in (e for key in kind.record_lists for e in record[key]):
        files = entry.get("files") if isinstance(entry, dict) else None
        if isinstance(files, dict):
            named.update({n: m for n, m in files.items() if isinstance(n, str) and kind.file_re.match(n)})
    return named


def _mismatch(path: Path, meta: object) -> Optional[str]:
    """None when `path` is a regular file of the recorded size and sha256, else what differs."""
    if not is_regular_file(path):
        return "is not a regular file (a symlink?)"
    if not isinstance(meta, dict):
        return "has no size/sha256 in the record"
    size = os.path.getsize(path)
    if size != meta.get("bytes"):
        return f"is {size} bytes, the record says {meta.get('bytes')}"
    if sha256_file(path) != meta.get("sha256"):
        return "differs from the recorded sha256"
    return None


def _is_our_metadata(path: Path, kind: OutputKind) -> bool:
    data = load_json_file(path) if is_regular_file(path) else None
    if not isinstance(data, dict):
        return False
    if path.name == DATASETS_STATE:
        files = data.get("_data_files")
        return isinstance(files, list) and all(
            isinstance(f, dict) and kind.file_re.match(str(f.get("filename", ""))) for f in files
        )
    return data.get("description") == kind.description


@dataclass
class Ownership:
    """The entries of an output folder, sorted by the rules of the module docstring."""

    manifest: Optional[dict] = None
    state: Optional[dict] = None
    owned: set[str] = field(default_factory=set)
    disputed: dict[str, str] = field(default_factory=dict)  # name -> why it is not provably ours
    foreign: set[str] = field(default_factory=set)  # other names: the user's, never touched


def _is_pending(out: Path, name: str, state: dict) -> bool:
    """A data file the state records as pending (written and checksummed, then killed between its rename and its
    record) whose size and sha256 match."""
    pending = state.get("pending")
    for entry in pending if isinstance(pending, list) else []:
        files = entry.get("files") if isinstance(entry, dict) else None
        if isinstance(files, dict) and name in files:
            return _mismatch(out / name, files[name]) is None
    return False


def ownership(out: Path, kind: OutputKind = PRETOKENIZE) -> Ownership:
    """Sort the entries of `out` into owned, disputed and foreign (reads every recorded file's sha256)."""
    entries = set(os.listdir(out)) - {LOCK_NAME}
    own = Ownership(_our_job_record(out / MANIFEST_NAME, kind), _our_job_record(out / kind.state_name, kind))
    for name, record in ((MANIFEST_NAME, own.manifest), (kind.state_name, own.state)):
        if record is not None:
            own.owned.add(name)
    journal = journal_path(out / kind.state_name)
    if journal.name in entries and is_our_journal(journal):  # the shards a run recorded since its state was written
        own.owned.add(journal.name)
        if own.state is not None and isinstance(own.state.get("journal"), str):
            own.state = replay(own.state, read_journal(out / kind.state_name, own.state["journal"]), str(journal))
    for name in (DATASETS_STATE, DATASETS_INFO):
        if name in entries and _is_our_metadata(out / name, kind):
            own.owned.add(name)
    recorded = recorded_temporaries(out)
    for record, source in ((own.manifest, MANIFEST_NAME), (own.state, kind.state_name)):
        for name, meta in (_recorded_files(record, kind) if record else {}).items():
            if name in entries and name not in own.owned and name not in own.disputed:
                problem = _mismatch(out / name, meta)
                if problem is None:
                    own.owned.add(name)
                else:
                    own.disputed[name] = f"recorded in {source} but {problem}"
    for name in sorted(entries - own.owned - set(own.disputed)):
        if not is_output_name(name, kind):
            own.foreign.add(name)
        elif name.endswith(".tmp"):
            if name in recorded and is_regular_file(out / name):
                own.owned.add(name)
            else:
                own.disputed[name] = (
                    f"has a temporary name this tool writes, but the folder's lock ({LOCK_NAME}) does not record it "
                    "as a file of a run of ours"
                )
        elif own.state is not None and is_regular_file(out / name) and _is_pending(out, name, own.state):
            own.owned.add(name)
        else:
            own.disputed[name] = "has a name this tool writes, but no manifest or state of ours here records it"
    return own


def clear_outputs(out: Path, names: Iterable[str], keep: Iterable[str] = (), kind: OutputKind = PRETOKENIZE) -> None:
    """Remove `names` (owned files, from `ownership`) except `keep`; the manifest and state file last, so that a
    kill midway leaves the proof of ownership of whatever is still there. Links are removed, never followed."""
    doomed = set(names) - set(keep)
    proofs = [n for n in (kind.state_name, MANIFEST_NAME) if n in doomed]
    for name in sorted(doomed - set(proofs)) + proofs:
        try:
            os.remove(out / name)
        except FileNotFoundError:
            pass
        note_temporary(out / name, False)  # a recorded temporary file: no longer there


def refuse_overwrite_of_inputs(
    output_path: str | os.PathLike, input_paths: Iterable[str | os.PathLike], flag_names: Sequence[str]
) -> None:
    """Raise DataError when writing `output_path` (a file or a folder, existing or not) could replace or write into
    one of `input_paths`: it is an input (the same path after symlinks, or the same file through a hard link), it
    lies inside an input folder, or (a folder) it contains an input. Inputs that do not exist are skipped (a hub
    dataset name). `flag_names` = (what the output is called, what the inputs are called) in the message: the CLI's
    flags (`("-o", "LENGTHS")`) or the API's argument names."""
    out_name, in_name = flag_names
    clash = input_clash(output_path, input_paths)
    if clash is not None:
        how, spec = clash
        advice = {"is": "write to another path", "inside": "write outside it", "contains": "write to a path outside it"}
        where = f"{out_name} {output_path} {'is inside' if how == 'inside' else how} the input {spec}"
        raise DataError(f"{where} ({in_name}); {advice[how]}")


def check_output_vs_inputs(out: Path, inputs: Sequence[str], input_name: str = "inputs") -> None:
    """Refuse an output folder that is, contains, or is inside an input (file or folder)."""
    refuse_overwrite_of_inputs(out, inputs, (arg("output"), arg(input_name)))


def _refuse_disputed(out: Path, own: Ownership) -> None:
    if own.disputed:
        name, why = sorted(own.disputed.items())[0]
        more = f" (and {len(own.disputed) - 1} more such file(s))" if len(own.disputed) > 1 else ""
        raise DataError(
            f"{out / name}: {why}{more}; it is not provably this tool's, so no run replaces or deletes it: "
            f"move it away (or delete it if it is not yours)"
        )


def _is_unstarted(state: dict, kind: OutputKind) -> bool:
    """The state of a run that recorded nothing yet (it failed or was stopped before its first shard)."""
    return all(not state[key] for key in kind.record_lists)


def prepare_output(
    out: Path,
    job: str,
    slice_: Optional[dict],
    overwrite: bool,
    kind: OutputKind = PRETOKENIZE,
    explain: Optional[Callable[[dict], Optional[str]]] = None,
) -> tuple[str, Optional[dict], set[str]]:
    """('fresh'|'resume'|'complete', state or manifest, owned names) for job `job` in the existing folder `out`.
    Refuses a folder holding something else, and any disputed file whatever the flags; with `overwrite` the owned
    files are left for the caller to clear (`clear_outputs`). A folder holding only the state of an unfinished run
    of other options that recorded nothing is reused (one log line). `explain(record)` may say how a different
    job differs (e.g. which input changed)."""
    manifest = _our_job_record(out / MANIFEST_NAME, kind)
    if not overwrite and manifest is not None and manifest.get("job") == job and manifest.get("slice") == slice_:
        return "complete", manifest, set()  # the caller verifies every byte
    own = ownership(out, kind)
    _refuse_disputed(out, own)
    state = own.state
    recorded = manifest if manifest is not None else state
    if recorded is None:
        if own.foreign and not overwrite:
            example = sorted(own.foreign)[0]
            raise DataError(
                f"{arg('output')} {out} is not empty and holds no {kind.command} job "
                f"({len(own.foreign)} entries, e.g. {example!r}); pass {arg('overwrite', True)} to use it "
                f"(your files stay)"
            )
        return "fresh", None, own.owned
    if overwrite:
        return "fresh", None, own.owned
    if manifest is None and recorded.get("job") == job and recorded.get("slice") == slice_:
        return "resume", recorded, own.owned
    if manifest is None and _is_unstarted(recorded, kind):
        print(
            f"{out}: reusing the folder: it holds only the state of an unfinished `balancer {kind.command}` run "
            f"with other inputs or options that wrote nothing",
            file=sys.stderr,
            flush=True,
        )
        return "fresh", None, own.owned
    why = (explain(recorded) if explain else None) or "other inputs or options"
    raise DataError(
        f"{arg('output')} {out} holds a different job of `balancer {kind.command}` ({why}); "
        f"pass {arg('overwrite', True)} to replace it"
    )


# ----------------------------------------------------------------------------------------------------------------
# the lock


def _lock_owner(path: Path) -> str:
    data = (load_json_file(path) if is_regular_file(path) else None) or {}
    return f"pid {data.get('pid', '?')} on host {data.get('host', '?')} since {data.get('started', '?')}"


_LOCK_KEYS = {"pid", "host", "started"}
_HELD: dict[str, OutputLock] = {}  # folder (real path) -> the lock this process holds on it


def _lock_record(data: bytes) -> Optional[dict]:
    """The lock file's record: {} when empty (created, not yet written), the JSON owner record this tool writes
    (pid, host, start, and the temporary files its run may have left: plain names), or None for other content."""
    if not data.strip():
        return {}
    try:
        record = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict) or not _LOCK_KEYS <= set(record) <= _LOCK_KEYS | {"temporary"}:
        return None
    names = record.get("temporary", [])
    if not isinstance(names, list) or not all(isinstance(n, str) and n == os.path.basename(n) for n in names):
        return None
    return record


def recorded_temporaries(out: Path) -> set[str]:
    """The temporary files the lock of `out` records (this process's lock, or the file a dead run left)."""
    held = _HELD.get(os.path.realpath(out))
    if held is not None:
        return set(held.temporary)
    path = out / LOCK_NAME
    try:
        record = _lock_record(path.read_bytes()) if is_regular_file(path) else None
    except OSError:
        record = None
    return set(record.get("temporary", [])) - {"", ".", ".."} if record else set()


class OutputLock:
    """An exclusive lock on an output folder, held while a run writes it: `DIR/.balancer.lock` names the owner
    (pid, host, start time) and carries an advisory `flock`, which the kernel drops when the owner dies (also on
    kill -9). A lock file left by a dead run is therefore taken over silently; one held by a live run makes the
    second run fail naming the file and its owner. `created`: this run made the folder, so a run that fails before
    writing anything into it removes it again (an empty folder only; `rmdir` never removes content)."""

    def __init__(self, out: Path, created: bool = False) -> None:
        self.path = out / LOCK_NAME
        self.fd: Optional[int] = None
        self.created = created
        self.temporary: set[str] = set()  # temporary files a run of ours may have left (module docstring)
        self._owner: dict = {}
        self._size = 0

    def __enter__(self) -> OutputLock:
        import fcntl

        while True:
            try:  # never through a symlink: the lock file is written
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
            except OSError as exc:
                if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):  # not a link: the folder is read-only
                    raise DataError(
                        f"{arg('output')} {self.path.parent}: the folder is not writable ({exc.strerror}): its lock "
                        f"file {LOCK_NAME} cannot be created; give a folder you can write to"
                    ) from None
                raise DataError(
                    f"{self.path}: cannot be opened as the lock file ({exc.strerror}); it must be a regular file "
                    f"(this tool never writes through a symlink): remove it"
                ) from None
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
                os.close(fd)
                raise DataError(
                    f"{self.path}: not a lock file of this tool (not a regular file, or a hard link to another file); "
                    f"remove it"
                )
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise DataError(
                    f"{self.path}: the folder is being written by another run ({_lock_owner(self.path)}); wait for "
                    f"it to finish, or stop it; if no such process is running, delete {self.path} and run again"
                ) from None
            try:
                same = os.fstat(fd).st_ino == os.lstat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:  # else the previous holder removed the file after we opened it: take the new one
                break
            os.close(fd)
        self._size = os.fstat(fd).st_size
        previous = _lock_record(os.pread(fd, self._size, 0))
        if previous is None:
            os.close(fd)
            raise DataError(f"{self.path}: not a lock file of this tool (other content); move it away")
        # a dead run's temporary files stay recorded until this run deletes them
        self.temporary = set(previous.get("temporary", [])) - {"", ".", ".."}
        self._owner = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
        self.fd = fd
        self._write()
        _HELD[os.path.realpath(self.path.parent)] = self
        record_temporaries(self.path.parent, self._note)
        return self

    def _note(self, name: str, exists: bool) -> bool:
        """The recorder of `balancer.temporaries.note_temporary` for this folder: the record is rewritten before a new
        temporary file is created and after one is gone."""
        if (name in self.temporary) == exists:
            return False
        (self.temporary.add if exists else self.temporary.discard)(name)
        self._write()
        return True

    def _write(self) -> None:
        """The owner record in one write over the old one (padded with spaces to its length): a kill at any moment
        leaves the old record or the new one."""
        data = (json.dumps({**self._owner, "temporary": sorted(self.temporary)}) + "\n").encode()
        data = data.ljust(self._size)
        assert self.fd is not None, "the record is written only while the lock is held (between enter and exit)"
        os.pwrite(self.fd, data, 0)
        self._size = len(data)

    def __exit__(self, *exc) -> None:
        if self.fd is None:
            return
        _HELD.pop(os.path.realpath(self.path.parent), None)
        record_temporaries(self.path.parent, None)
        self.temporary = {n for n in self.temporary if os.path.lexists(self.path.parent / n)}
        if self.temporary:  # a temporary file could not be removed: the lock file keeps its record for the next run
            self._write()
        else:
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass
        os.close(self.fd)
        self.fd = None
        if self.created:
            try:
                os.rmdir(self.path.parent)
            except OSError:  # not empty: the run wrote something (or another process did)
                pass


def open_output(out: Path, inputs: Sequence[str], input_name: str = "inputs") -> OutputLock:
    """Create `out` (refusing a non-folder, or a folder that is, holds or lies in an input) and return its lock
    (use as a context manager; a folder it created and the run left empty is removed on exit)."""
    if os.path.islink(out):  # writing into it would write into (or replace files of) whatever it points to
        raise DataError(
            f"{arg('output')} {out} is a symbolic link (to {os.readlink(out)}): a run never writes through a link; "
            "give the real folder"
        )
    check_output_vs_inputs(out, inputs, input_name)
    if out.exists() and not out.is_dir():
        raise DataError(f"{arg('output')} {out} exists and is not a directory")
    created = not os.path.lexists(out)
    out.mkdir(parents=True, exist_ok=True)
    return OutputLock(out, created)
