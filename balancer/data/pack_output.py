"""The output folder of `balancer pack`: which files are provably ours, and whether a folder may be written (fresh,
resumed, already complete, or refused).

Ownership follows `pretokenize`'s rules: a file is ours only when this tool's pack manifest or state file in the
folder names it (shards, plans), when its content is what this tool writes (`state.json`, `dataset_info.json`),
or when it has one of our names in a folder holding such a manifest or state (left by a killed run). `--overwrite`
deletes only those; any other file is the user's and is never deleted (a user file with one of our names is
refused). A state file that has recorded nothing yet (a run stopped before its first plan) is replaced freely.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Optional

from .manifest import MANIFEST_NAME, load_json_file
from .output import LOCK_NAME
from .pack_rows import PackError

PACK_FORMAT = "balancer-packed"
PACK_FORMAT_VERSION = 1
PACK_STATE_NAME = ".pack-state.json"
PACK_DESCRIPTION = "balancer pack output: one packed micro-batch per row, ordered (epoch, step, micro-batch, DP rank)"
DATASETS_FILES = ("state.json", "dataset_info.json")
_PACK_FILE_RE = re.compile(r"^(shard-\d{5,}\.arrow|plan-epoch-\d{5,}\.json)$")


def is_pack_name(name: str) -> bool:
    """A name `balancer pack` may write into its output folder (final or temporary)."""
    base = name[: -len(".tmp")] if name.endswith(".tmp") else name
    return base in (MANIFEST_NAME, PACK_STATE_NAME, *DATASETS_FILES) or bool(_PACK_FILE_RE.match(base))


def job_record(path: Path) -> Optional[dict]:
    """The pack manifest or state file at `path` when this tool wrote it, else None."""
    data = load_json_file(path)
    if not isinstance(data, dict) or "job" not in data:
        return None
    if not all(isinstance(data.get(k), list) for k in ("plans", "shards")):
        return None
    if path.name == MANIFEST_NAME and data.get("format") != PACK_FORMAT:
        return None
    return data


def _named_files(record: dict) -> set[str]:
    names = set()
    for entry in record["plans"] + record["shards"]:
        files = entry.get("files") if isinstance(entry, dict) else None
        if isinstance(files, dict):
            names.update(n for n in files if isinstance(n, str) and _PACK_FILE_RE.match(n))
    return names


def _is_our_metadata(path: Path) -> bool:
    data = load_json_file(path)
    if not isinstance(data, dict):
        return False
    if path.name == "state.json":
        files = data.get("_data_files")
        return isinstance(files, list) and all(
            isinstance(f, dict) and _PACK_FILE_RE.match(str(f.get("filename", ""))) for f in files
        )
    return data.get("description") == PACK_DESCRIPTION


def owned_files(out: Path) -> set[str]:
    """Names in `out` this tool provably wrote (see the module docstring)."""
    entries = set(os.listdir(out))
    records = [r for r in (job_record(out / MANIFEST_NAME), job_record(out / PACK_STATE_NAME)) if r]
    owned = {n for n in (MANIFEST_NAME, PACK_STATE_NAME) if n in entries and job_record(out / n)}
    owned |= {n for n in DATASETS_FILES if n in entries and _is_our_metadata(out / n)}
    if PACK_STATE_NAME + ".tmp" in entries:  # a hidden name of ours: a run killed before its first state rename
        owned.add(PACK_STATE_NAME + ".tmp")
    for record in records:
        owned |= _named_files(record) & entries
    if records:  # leftovers of a killed run: files not yet recorded, temporary files
        owned |= {n for n in entries if is_pack_name(n) or n.startswith(".plan-epoch-")}
    return owned


def clear_owned(out: Path, keep: Iterable[str] = ()) -> None:
    """Remove the files we own in `out` except `keep`; the manifest and state file last, so that a kill midway
    leaves the proof of ownership of whatever is still there."""
    doomed = owned_files(out) - set(keep)
    proofs = [n for n in (PACK_STATE_NAME, MANIFEST_NAME) if n in doomed]
    for name in sorted(doomed - set(proofs)) + proofs:
        try:
            os.remove(out / name)
        except FileNotFoundError:
            pass


def prepare_pack_output(out: Path, job: str, overwrite: bool) -> tuple[str, Optional[dict]]:
    """('fresh'|'resume'|'complete', state or manifest) for writing job `job` into the folder `out` (created)."""
    if out.exists() and not out.is_dir():
        raise PackError(f"--output {out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    owned = owned_files(out)
    foreign = sorted(set(os.listdir(out)) - owned - {LOCK_NAME})
    manifest, state = job_record(out / MANIFEST_NAME), job_record(out / PACK_STATE_NAME)
    idle = manifest is None and (state is None or not (state["plans"] or state["shards"]))
    if idle and not foreign:
        clear_owned(out)
        return "fresh", None
    if not overwrite:
        if manifest is not None and manifest["job"] == job:
            return "complete", manifest
        if manifest is None and state is not None and state["job"] == job:
            return "resume", state
        if manifest is not None or state is not None:
            raise PackError(f"--output {out} holds a different pack job; pass --overwrite to replace it")
        raise PackError(
            f"--output {out} is not empty and holds no pack job ({len(foreign)} entries, e.g. {foreign[0]!r}); "
            f"pass --overwrite to use it"
        )
    clashing = [n for n in foreign if is_pack_name(n)]
    if clashing:
        raise PackError(
            f"--output {out}: {clashing[0]!r} has a name `balancer pack` writes but was not written by it (no pack "
            f"manifest or state names it); move it away, --overwrite never deletes your files"
        )
    clear_owned(out)
    return "fresh", None
