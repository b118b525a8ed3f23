"""The output folder of `pretokenize` and `merge`: which files are ours, and whether a folder may be written
(fresh, resumed, already complete, or refused)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Optional

from .manifest import MANIFEST_NAME, STATE_NAME, load_json_file
from .readers import PretokenizeError

_SHARD_FILE_RE = re.compile(r"^shard-\d{5,}\.(arrow|lengths\.npy|doc_ids\.npy)$")


def is_output_name(name: str) -> bool:
    """True for a file name this tool writes into an output folder."""
    return (
        name in (MANIFEST_NAME, STATE_NAME, "state.json", "dataset_info.json")
        or name.endswith(".tmp")
        or bool(_SHARD_FILE_RE.match(name))
    )


def clear_outputs(out: Path, keep: Iterable[str] = ()) -> None:
    """Remove our files from `out`, except those named in `keep`."""
    keep = set(keep)
    for name in os.listdir(out):
        if name not in keep and is_output_name(name):
            os.remove(out / name)


def prepare_output(out: Path, job: str, slice_: Optional[dict], overwrite: bool) -> tuple[str, Optional[dict]]:
    """('fresh'|'resume'|'complete', state or manifest). Refuses a folder holding something else."""
    if out.exists() and not out.is_dir():
        raise PretokenizeError(f"--output {out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    entries = os.listdir(out)
    if not entries:
        return "fresh", None
    manifest = load_json_file(out / MANIFEST_NAME)
    state = load_json_file(out / STATE_NAME)
    if not overwrite:
        if manifest is not None and manifest.get("job") == job and manifest.get("slice") == slice_:
            return "complete", manifest
        if manifest is None and state is not None and state.get("job") == job and state.get("slice") == slice_:
            return "resume", state
        if manifest is not None or state is not None:
            raise PretokenizeError(
                f"--output {out} holds a different job (other inputs, tokenizer or options); "
                f"pass --overwrite to replace it"
            )
        raise PretokenizeError(
            f"--output {out} is not empty and holds no pretokenize job "
            f"({len(entries)} entries, e.g. {sorted(entries)[0]!r}); pass --overwrite to use it"
        )
    clear_outputs(out)
    return "fresh", None
