"""Single output files (plans, cost models, pictures), written atomically.

`atomic_write(path, write)` writes through a temporary file in the same folder, renamed over `path`: a
reader sees the old file or the new one, never half of one; a symbolic link at `path` (to a file, a folder or a
device) is refused, never replaced nor written through.

Temporary names are recorded before they exist (balancer.temporaries): `atomic_write` announces its temporary file
to the writer holding the folder, if any, before creating it and after renaming or removing it.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from balancer.temporaries import note_temporary

__all__ = ["OutputPathError", "atomic_write", "refuse_link"]


class OutputPathError(ValueError):
    """An output path that would replace an input, a link or a file of a balancer data folder (where a command's
    outputs may go: balancer.data.output_paths)."""


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> None:
    """Create `path`'s folder if needed and write it through a temporary file renamed over it (fsync first).
    `write(f)` gets the binary file. The file gets the permissions the umask allows (0666 & ~umask), like any
    ordinary file; an OSError without a file name gets `path` as its file name."""
    path = Path(path)
    refuse_link(path, "")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _new_temporary(path)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        refuse_link(path, "")  # again: a link made while the file was written is not replaced either
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


def refuse_link(path: str | os.PathLike, flag: str) -> None:
    """OutputPathError when `path` is a symbolic link: neither it nor what it points to is ever replaced."""
    if os.path.islink(path):
        target = os.readlink(os.fspath(path))
        raise OutputPathError(
            f"{flag + ' ' if flag else ''}{path} is a symbolic link (to {target}): an output is never "
            "written through a link nor replaces one; give another name or remove the link"
        )


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    note_temporary(path, False)
