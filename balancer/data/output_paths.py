"""Where a command's single output file (a plan, a cost model, a picture) may be written: never over one of its
inputs, inside a folder it reads, or inside a balancer data folder (one that holds a pretokenize or pack manifest,
state or lock: a plan written as `tok/manifest.json` would replace the folder's manifest). The data layer owns this
rule, as it owns the folders' marker files; the file is then written with `balancer.files.atomic_write`.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path

from balancer.files import OutputPathError, refuse_link
from balancer.paths import input_clash

__all__ = ["OutputPathError", "check_output_file", "data_folder_marker"]


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
    refuse_link(path, flag)
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
