"""Single output files (plans, cost models, pictures): where one may be written, and writing it atomically.

`check_output_file(path, inputs, flag)` refuses an output that is one of the command's inputs (also through a
link), lies inside a folder the command reads, or lies inside a balancer data folder (one that holds a
pretokenize or pack manifest, state or lock): a plan written as `tok/manifest.json` would replace the folder's
manifest. `atomic_write(path, write)` writes through a temporary file in the same folder, renamed over `path`: a
reader sees the old file or the new one, never half of one; a symbolic link at `path` (to a file, a folder or a
device) is refused, never replaced nor written through.

Temporary names are recorded before they exist (balancer.temporaries): `atomic_write` announces its temporary file
to the writer holding the folder, if any, before creating it and after renaming or removing it.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import BinaryIO

from balancer.paths import input_clash
from balancer.temporaries import note_temporary

__all__ = [
    "OutputPathError",
    "atomic_write",
    "check_output_file",
    "data_folder_marker",
]


class OutputPathError(ValueError):
    """An output path that would replace an input or a file of a balancer data folder."""


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> None:
    """Create `path`'s folder if needed and write it through a temporary file renamed over it (fsync first).
    `write(f)` gets the binary file. The file gets the permissions the umask allows (0666 & ~umask), like any
    ordinary file; an OSError without a file name gets `path` as its file name."""
    path = Path(path)
    _refuse_link(path, "")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _new_temporary(path)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        _refuse_link(path, "")  # again: a link made while the file was written is not replaced either
        os.replace(tmp, path)
        note_temporary(tmp, False)
    except OSError as e:
        _remove(tmp)
        if e.filename is None:
            e.filename = os.fspath(path)
        raise
    except BaseException:
        _remove(tmp)
        raise


def _new_temporary(path: Path) -> tuple[int, str]:
    """(descriptor, name) of a new temporary file beside `path` (mode 0600, never through a link), its name
    announced (`note_temporary`) before it is created."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        # the temporary name stays short: a target name near the 255-byte limit must still be writable
        tmp = os.path.join(path.parent, f".{path.name[:40]}.{secrets.token_hex(6)}.tmp")
        new = note_temporary(tmp, True)
        try:
            return os.open(tmp, flags, 0o600), tmp
        except FileExistsError:  # someone else's file: never ours to remove, nor to record
            if new:
                note_temporary(tmp, False)
        except OSError as e:  # a read-only folder, no space: nothing was created
            note_temporary(tmp, False)
            if e.filename is None:
                e.filename = os.fspath(path)
            raise
    raise FileExistsError(f"{path.parent}: no free temporary name for {path.name}")


def _refuse_link(path: str | os.PathLike, flag: str) -> None:
    """OutputPathError when `path` is a symbolic link: neither it nor what it points to is ever replaced."""
    if os.path.islink(path):
        raise OutputPathError(
            f"{flag + ' ' if flag else ''}{path} is a symbolic link (to {os.readlink(path)}): an output is never "
            "written through a link nor replaces one; give another name or remove the link"
        )


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    note_temporary(path, False)


def data_folder_marker(folder: str | os.PathLike) -> str | None:
    """The name of the file that makes `folder` a balancer data folder (a pretokenized or packed folder's
    manifest, a run's progress state or lock), or None."""
    import json

    from balancer.data.pack.output import PACK
    from balancer.data.shards.manifest import FORMAT_NAME, MANIFEST_NAME
    from balancer.data.shards.output import LOCK_NAME, PRETOKENIZE

    for name in (LOCK_NAME, PRETOKENIZE.state_name, PACK.state_name):
        if os.path.lexists(os.path.join(folder, name)):
            return name
    try:
        with open(os.path.join(folder, MANIFEST_NAME), "rb") as f:
            manifest = json.loads(f.read())
    except (OSError, ValueError):
        return None
    if isinstance(manifest, dict) and manifest.get("format") in (FORMAT_NAME, PACK.format_name):
        return MANIFEST_NAME
    return None


def _check_name_lengths(path: str | os.PathLike, folder: str, flag: str) -> None:
    """Every part of `path` still to be created fits the file system's name limit (checked before any work, so a
    long name is refused before planning, not after it)."""
    try:
        limit = os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return
    for part in Path(os.path.abspath(path)).parts:
        if len(os.fsencode(part)) > limit:
            raise OutputPathError(
                f"{flag} {path}: the name {part[:20]}... is {len(os.fsencode(part))} bytes, over the file system's "
                f"limit of {limit}; give a shorter name"
            )


def check_output_file(path: str | os.PathLike, inputs: Sequence[str | os.PathLike], flag: str) -> None:
    """Refuse (OutputPathError naming `flag`) an output file `path` that is an input (also through a symbolic or a
    hard link), lies inside an input folder or inside a balancer data folder (`input_clash`), is a folder, or is a
    device, pipe or socket (`/dev/null`: the rename would replace it)."""
    if not os.fspath(path):
        raise OutputPathError(f"{flag}: an empty path; give a file name")
    clash = input_clash(path, inputs)
    if clash is not None and clash[0] == "is":
        raise OutputPathError(f"{flag} {path} is the input {clash[1]}: writing it would replace it; pick another file")
    if clash is not None and clash[0] == "inside":
        raise OutputPathError(f"{flag} {path} lies inside the input folder {clash[1]}: pick a file outside it")
    _refuse_link(path, flag)
    if os.path.isdir(path):  # (also where it holds an input)
        raise OutputPathError(f"{flag} {path} is a folder: give a file name")
    if os.path.lexists(path) and not stat.S_ISREG(os.lstat(path).st_mode) and not os.path.islink(path):
        # the file is written beside it and renamed over it: a device (/dev/null) or pipe would be replaced
        raise OutputPathError(
            f"{flag} {path} is not a regular file (a device, pipe or socket): writing would replace it; "
            "give a file name"
        )
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(folder):  # the nearest part of the path that exists must be a writable folder
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise OutputPathError(f"{flag} {path}: {folder} is a file, not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputPathError(f"{flag} {path}: the folder {folder} is not writable (check its permissions)")
    _check_name_lengths(path, folder, flag)
    parent = os.path.dirname(os.path.realpath(path))
    marker = data_folder_marker(parent)
    if marker is not None:
        raise OutputPathError(
            f"{flag} {path} lies inside the balancer data folder {parent} (it holds {marker}): pick a file outside it"
        )
