"""Temporary names recorded before they exist: a writer that holds a folder (the output lock of `pretokenize`,
`merge` and `pack`, balancer.data.shards.output) registers a recorder for it (`record_temporaries`), and whatever
creates a temporary file there (`balancer.files.atomic_write`, the data writers) announces it first and again once
the file is renamed or removed (`note_temporary`). So a temporary file is deleted later only because a record of
ours names it, never because of its name. Imports nothing of the project (the lowest layer)."""

from __future__ import annotations

import os
from collections.abc import Callable

__all__ = ["note_temporary", "record_temporaries"]

_RECORDERS: dict[str, Callable[[str, bool], bool]] = {}  # folder (real path) -> its writer's recorder


def record_temporaries(folder: str | os.PathLike, recorder: Callable[[str, bool], bool] | None) -> None:
    """While a writer holds `folder`: `recorder(name, True)` before a temporary file `name` is created in it and
    `recorder(name, False)` once that file is renamed or removed (`note_temporary`; it returns whether the record
    changed); `None` ends the recording."""
    key = os.path.realpath(folder)
    if recorder is None:
        _RECORDERS.pop(key, None)
    else:
        _RECORDERS[key] = recorder


def note_temporary(path: str | os.PathLike, exists: bool) -> bool:
    """Announce that the temporary file `path` is about to be created (`exists=True`; call it before creating the
    file) or is gone (renamed or removed), to the writer holding its folder, if one does; True when that changed
    the record (False: no writer holds the folder, or the record already said so)."""
    if _RECORDERS:
        recorder = _RECORDERS.get(os.path.realpath(os.path.dirname(os.path.abspath(path))))
        if recorder is not None:
            return recorder(os.path.basename(path), exists)
    return False
