"""Errors of the data commands: `DataError` (bad input, a refused output folder, ...; the message names the file)
and one line for an operating-system error (`describe_os_error`: the file, what went wrong, and what to do).

Messages that name an option build the name with `arg("max_length")` or `arg("on_error", "skip")`: `str(exc)`
then speaks the Python API (`max_length`, `on_error='skip'`), and the CLI renders the same message with its flags
(`--max-length`, `--on-error skip`) through `render_message(exc, flags)`, one table of names in `balancer.cli.data`.
"""

from __future__ import annotations

import ast
import errno
import re
from collections.abc import Mapping
from typing import Any, Optional

_MARK = "\x1f"  # unit separator: never in a file name a user types
_ARG_RE = re.compile(_MARK + r"([A-Za-z_][A-Za-z0-9_]*)(?:\x1e([^\x1f]*))?" + _MARK)
_NO_VALUE = object()


def arg(name: str, value: Any = _NO_VALUE) -> str:
    """An option's name (or `name=value` suggestion) inside a DataError message, rendered per surface."""
    if value is _NO_VALUE:
        return f"{_MARK}{name}{_MARK}"
    return f"{_MARK}{name}\x1e{value!r}{_MARK}"


def _python_form(match: re.Match) -> str:
    name, value = match.group(1), match.group(2)
    return name if value is None else f"{name}={value}"


def render_message(message: str, flags: Optional[Mapping[str, str]] = None) -> str:
    """`message` with its option names as Python argument names (`flags` None) or as the CLI flags in `flags`
    (argument name -> flag; a True value renders as the bare flag, other values after it)."""
    if flags is None:
        return _ARG_RE.sub(_python_form, message)

    def cli_form(match: re.Match) -> str:
        name, value = match.group(1), match.group(2)
        flag = flags.get(name)
        if flag is None:
            return _python_form(match)
        if value is None:
            return flag
        shown = ast.literal_eval(value)
        return flag if shown is True else f"{flag} {shown}"

    return _ARG_RE.sub(cli_form, message)


class DataError(RuntimeError):
    """A data job cannot proceed: bad input (the message names the file and line), a refused output folder, ..."""

    def __str__(self) -> str:
        return render_message(self.raw_message)

    @property
    def raw_message(self) -> str:
        """The message with its option markers (see `arg`)."""
        return str(self.args[0]) if self.args else ""


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
    errno.ELOOP: "it is a symbolic link (or a loop of them); this tool never writes through one: remove it",
}


def describe_os_error(exc: OSError) -> str:
    """'PATH: reason (what to do)' for an OSError (no traceback needed); without a file name, the message as
    raised (which names its file) or the reason."""
    reason = exc.strerror or str(exc)
    hint = _HINTS.get(exc.errno or 0)
    if exc.filename is None:
        return reason + (f" ({hint})" if hint else "")
    where = exc.filename if exc.filename2 is None else f"{exc.filename} -> {exc.filename2}"
    return f"{where}: {reason}" + (f" ({hint})" if hint else "")
