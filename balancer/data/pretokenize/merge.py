"""`merge`: join the outputs of `pretokenize --num-shards K --shard-index i` runs into one folder."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import numpy as np

from balancer.data.pretokenize.pipeline import MAX_SKIPPED_EXAMPLES, finish_output, new_counters
from balancer.data.pretokenize.summary import log, summarize
from balancer.data.shards.checks import open_folder
from balancer.data.shards.errors import DataError, arg
from balancer.data.shards.journal import JournaledState, journal_path, remove_state
from balancer.data.shards.manifest import STATE_NAME, create_new_file, sha256_file, shard_file_names
from balancer.data.shards.output import clear_outputs, is_our_record, is_regular_file, open_output, prepare_output
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


def _renamed(entry: dict, index: int) -> dict:
    """A part's shard `entry` as shard `index` of the merged folder (the same files under the new names)."""
    new = dict(entry, name=f"shard-{index:05d}")
    names = zip(shard_file_names(entry["name"]), shard_file_names(new["name"]))
    new["files"] = {new_fn: entry["files"][old_fn] for old_fn, new_fn in names}
    return new


def _link_shard(part: str, entry: dict, new: dict, out: Path, run: JournaledState) -> None:
    """Hard-link (or copy) the files of `entry` of `part` into `out` under the names of `new`, checked against
    their checksums, then recorded as pending in the journal (so the files are provably ours once renamed),
    renamed, and recorded as the shard `new`."""
    for old_fn, new_fn in zip(shard_file_names(entry["name"]), new["files"]):
        src = Path(part) / old_fn
        tmp = out / (new_fn + ".tmp")
        note_temporary(tmp, True)  # recorded before it exists (the output rules cleared a recorded leftover)
        try:
            os.link(src, tmp, follow_symlinks=True)  # a new entry: never writes through a link at `tmp`
        except OSError:
            with open(src, "rb") as fin, os.fdopen(create_new_file(tmp), "wb") as fout:
                shutil.copyfileobj(fin, fout, 1 << 23)
        if sha256_file(tmp) != new["files"][new_fn]["sha256"]:
            os.remove(tmp)
            note_temporary(tmp, False)
            raise DataError(f"merge: {src}: sha256 mismatch (run `balancer verify {part}`)")
    run.record({"pending": [{"name": new["name"], "files": new["files"]}]})
    for new_fn in new["files"]:
        os.replace(out / (new_fn + ".tmp"), out / new_fn)
        note_temporary(out / (new_fn + ".tmp"), False)
    run.record({"shard": new})


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
    checked against its part's checksum. A killed merge resumes after the shards its state and journal record (the
    ones equal to what the parts give). Returns the merged manifest."""
    by_index = _slices_by_index(parts)
    first = by_index[0][1]
    out = Path(output)
    with open_output(out, parts, "parts"):
        status, prev, owned = prepare_output(out, first["job"], None, overwrite)
        if status == "complete":
            remove_state(out / STATE_NAME, is_our_record)
            log(f"{out}: already complete")
            assert prev is not None, "the folder is complete: prev is its manifest"
            return prev
        links = _links(by_index)
        kept = _recorded_prefix(out, prev, [new for _, _, new in links])
        if kept:
            log(f"{out}: resuming after {kept} linked shard(s)")
        keep = {fn for _, _, new in links[:kept] for fn in new["files"]}
        clear_outputs(out, owned, keep=keep | {STATE_NAME, journal_path(out / STATE_NAME).name})
        state = {**state_header("state"), "job": first["job"], "slice": None, "shards": [n for *_, n in links[:kept]]}
        run = JournaledState(out / STATE_NAME, state)
        try:
            for part, entry, new in links[kept:]:
                _link_shard(part, entry, new, out, run)
        except BaseException:
            run.abort()
            raise
        run.compact()
        manifest = _merged_manifest(first, by_index, [new for _, _, new in links])
        finish_output(out, manifest, np.dtype(first["tokenizer"]["dtype"]))
    summarize(out, manifest)
    return manifest


def _links(by_index: dict[int, tuple[str, dict]]) -> list[tuple[str, dict, dict]]:
    """(part, its shard entry, the merged shard entry) of every shard of the merged folder, in order."""
    links: list[tuple[str, dict, dict]] = []
    for i in range(len(by_index)):
        part, m = by_index[i]
        for entry in m["shards"]:
            links.append((part, entry, _renamed(entry, len(links))))
    return links


def _recorded_prefix(out: Path, prev: Optional[dict], planned: list[dict]) -> int:
    """How many of the `planned` shards the state of a killed run (`prev`: state and journal) records exactly as
    planned with every file in `out`, from the first on (the ownership rules checked the size and sha256 of each
    recorded file there): those files are kept, the rest redone."""
    recorded = prev.get("shards") if isinstance(prev, dict) else None
    n = 0
    for have, want in zip(recorded if isinstance(recorded, list) else [], planned):
        if have != want or not all(is_regular_file(out / name) for name in want["files"]):
            break
        n += 1
    return n


def _merged_manifest(first: dict, by_index: dict[int, tuple[str, dict]], shards: list[dict]) -> dict:
    """The merged manifest: the parts' counts and skipped records added up, `shards` (renumbered) as its shards."""
    k = len(by_index)
    counts = new_counters()
    del counts["skipped_examples"]
    skipped: list = []
    for i in range(k):
        m = by_index[i][1]
        _add_counts(counts, m["counts"])
        skipped.extend(m["skipped_records"][: MAX_SKIPPED_EXAMPLES - len(skipped)])
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
