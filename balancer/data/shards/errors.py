"""Errors of the data commands: `DataError` (bad input, a refused output folder, ...; the message names the file)
and one line for an operating-system error (`describe_os_error`: the file, what went wrong, and what to do)."""

from __future__ import annotations

import errno


class DataError(RuntimeError):
    """A data job cannot proceed: bad input (the message names the file and line), a refused output folder, ..."""


_HINTS = {
    errno.ENOSPC: "free space on that disk (or pick another folder), then run the same command again",
    errno.EDQUOT: "the disk quota is used up: free space, then run the same command again",
    errno.EACCES: "check the file's and its folders' permissions",
    errno.EPERM: "check the file's and its folders' permissions",
    errno.EROFS: "the filesystem is read-only: pick a writable folder",
    errno.ENOTDIR: "a part of the path is a file, not a folder",
    errno.EISDIR: "a folder was given where a file is expected",
    errno.ENOENT: "check the path",
    errno.EMFILE: "too many open files: raise the limit (ulimit -n)",
}


def describe_os_error(exc: OSError) -> str:
    """'PATH: reason (what to do)' for an OSError (no traceback needed)."""
    where = exc.filename if exc.filename is not None else "(no file)"
    if exc.filename2 is not None:
        where = f"{where} -> {exc.filename2}"
    reason = exc.strerror or str(exc)
    hint = _HINTS.get(exc.errno or 0)
    return f"{where}: {reason}" + (f" ({hint})" if hint else "")
