"""`merge`: join the outputs of `pretokenize --num-shards K --shard-index i` runs into one folder."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from balancer.data.pretokenize.pipeline import MAX_SKIPPED_EXAMPLES, finish_output, new_counters
from balancer.data.pretokenize.summary import log, summarize
from balancer.data.shards.checks import open_folder
from balancer.data.shards.errors import DataError, arg
from balancer.data.shards.manifest import (
    STATE_NAME,
    atomic_write_json,
    create_new_file,
    sha256_file,
    shard_file_names,
)
from balancer.data.shards.output import clear_outputs, open_output, prepare_output
from balancer.data.shards.schema import state_header
from balancer.temporaries import note_temporary


def _slices_by_index(parts: Sequence[str]) -> dict[int, tuple[str, dict]]:
    """slice index -> (folder, manifest); refuses parts of different jobs, duplicates and missing slices."""
    if not parts:
        raise DataError("merge: no input folders")
    mans = [(p, open_folder(p).manifest) for p in parts]  # checked: names inside the part, index intact
    first = mans[0][1]
    for p, m in mans:
        if m.get("slice") is None:
            raise DataError(f"merge: {p} is not a {arg('num_shards')} slice")
        for key in ("job", "tokenizer", "options"):
            if m[key] != first[key]:
                raise DataError(
                    f"merge: {p} differs from {mans[0][0]} in {key} (different inputs, tokenizer or options)"
                )
    k = first["slice"]["num_shards"]
    by_index: dict[int, tuple[str, dict]] = {}
    for p, m in mans:
        if m["slice"]["num_shards"] != k:
            raise DataError(f"merge: {p} is a slice of {m['slice']['num_shards']}, others of {k}")
        i = m["slice"]["shard_index"]
        if i in by_index:
            raise DataError(f"merge: {p} and {by_index[i][0]} are both slice {i}")
        by_index[i] = (p, m)
    missing = sorted(set(range(k)) - set(by_index))
    if missing:
        raise DataError(f"merge: missing slice(s) {missing} of {k}")
    return by_index


def _link_shard(part: str, entry: dict, out: Path, index: int, state: dict) -> dict:
    """Hard-link (or copy) one shard of `part` into `out` as shard `index`, checked against its checksums, then
    recorded as pending in the state (so the files are provably ours once renamed) and renamed."""
    new = dict(entry)
    new["name"] = f"shard-{index:05d}"
    new["files"] = {}
    for old_fn, new_fn in zip(shard_file_names(entry["name"]), shard_file_names(new["name"])):
        src = Path(part) / old_fn
        meta = entry["files"][old_fn]
        tmp = out / (new_fn + ".tmp")
        note_temporary(tmp, True)  # recorded before it exists (the output rules cleared a recorded leftover)
        try:
            os.link(src, tmp, follow_symlinks=True)  # a new entry: never writes through a link at `tmp`
        except OSError:
            with open(src, "rb") as fin, os.fdopen(create_new_file(tmp), "wb") as fout:
                shutil.copyfileobj(fin, fout, 1 << 23)
        if sha256_file(tmp) != meta["sha256"]:
            os.remove(tmp)
            note_temporary(tmp, False)
            raise DataError(f"merge: {src}: sha256 mismatch (run `balancer verify {part}`)")
        new["files"][new_fn] = meta
    state["pending"].append({"name": new["name"], "files": new["files"]})
    atomic_write_json(out / STATE_NAME, state)
    for new_fn in new["files"]:
        os.replace(out / (new_fn + ".tmp"), out / new_fn)
        note_temporary(out / (new_fn + ".tmp"), False)
    return new


def _add_counts(counts: dict, part_counts: dict) -> None:
    for key, v in part_counts.items():
        if key == "skipped":
            for reason, n in v.items():
                counts["skipped"][reason] = counts["skipped"].get(reason, 0) + n
        else:
            counts[key] += v


def merge(parts: Sequence[str], output: str | os.PathLike, overwrite: bool = False) -> dict:
    """Join the outputs of `--num-shards K --shard-index i` runs (all K, any order) into one folder whose rows
    equal a single run's (shard boundaries may differ). Files are hard-linked when possible, else copied; each is
    checked against its part's checksum. Returns the merged manifest."""
    by_index = _slices_by_index(parts)
    first = by_index[0][1]
    out = Path(output)
    with open_output(out, parts, "parts"):
        status, prev, owned = prepare_output(out, first["job"], None, overwrite)
        if status == "complete":
            log(f"{out}: already complete")
            return prev
        clear_outputs(out, owned)
        state = {**state_header("state"), "job": first["job"], "slice": None, "shards": [], "pending": []}
        atomic_write_json(out / STATE_NAME, state)
        manifest = _merged_manifest(first, by_index, out, state)
        finish_output(out, manifest, np.dtype(first["tokenizer"]["dtype"]))
    summarize(out, manifest)
    return manifest


def _merged_manifest(first: dict, by_index: dict[int, tuple[str, dict]], out: Path, state: dict) -> dict:
    """Link every part's shards into `out` (renumbered) and build the merged manifest."""
    k = len(by_index)
    counts = new_counters()
    del counts["skipped_examples"]
    skipped: list = []
    shards: list[dict] = []
    for i in range(k):
        p, m = by_index[i]
        _add_counts(counts, m["counts"])
        skipped.extend(m["skipped_records"][: MAX_SKIPPED_EXAMPLES - len(skipped)])
        for entry in m["shards"]:
            shards.append(_link_shard(p, entry, out, len(shards), state))
    manifest = {k_: v for k_, v in first.items() if k_ not in ("slice", "counts", "skipped_records", "shards")}
    manifest.update(
        {
            "slice": None,
            "merged_from": [str(by_index[i][0]) for i in range(k)],
            "counts": counts,
            "skipped_records": skipped,
            "shards": shards,
        }
    )
    return manifest
