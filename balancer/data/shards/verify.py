"""`verify`: the full check of a finished pretokenized folder (every byte of every file)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import numpy as np

from balancer.data.shards.checks import check_file_name, check_manifest_structure
from balancer.data.shards.dataset import _open_arrow
from balancer.data.shards.errors import DataError
from balancer.data.shards.manifest import MANIFEST_NAME, load_manifest, shard_file_names, verify_shard_files
from balancer.data.shards.output import is_output_name


def _row_lengths(table) -> np.ndarray:
    col = table.column("input_ids")
    if not col.num_chunks:
        return np.zeros(0, np.int64)
    return np.concatenate([np.diff(c.offsets.to_numpy()) for c in col.chunks])


def _check_shard(out: Path, entry: dict, cap: Optional[int], last_doc: int) -> tuple[list[str], int, int, int]:
    """(problems, rows, tokens, last doc_id) of one shard whose files match their checksums."""
    arrow, lfile, dfile = shard_file_names(entry["name"])
    try:
        table = _open_arrow(out / arrow)
        lengths = _row_lengths(table)
        docs = table.column("doc_id").to_numpy()
    except Exception as exc:  # noqa: BLE001
        return [f"{out / arrow}: unreadable Arrow data ({type(exc).__name__}: {exc})"], 0, 0, last_doc
    problems: list[str] = []
    index_lengths = np.load(out / lfile, allow_pickle=False)
    index_docs = np.load(out / dfile, allow_pickle=False)
    if table.num_rows != entry["rows"]:
        problems.append(f"{out / arrow}: {table.num_rows} rows, manifest says {entry['rows']}")
    if not np.array_equal(index_lengths, lengths):
        problems.append(f"{out / lfile}: lengths index differs from the token data in {arrow}")
    if not np.array_equal(index_docs, docs):
        problems.append(f"{out / dfile}: doc_id index differs from the doc_id column in {arrow}")
    if int(lengths.sum()) != entry["tokens"]:
        problems.append(f"{out / arrow}: {int(lengths.sum())} tokens, manifest says {entry['tokens']}")
    if len(lengths) and lengths.min() < 1:
        problems.append(f"{out / arrow}: holds empty rows")
    if cap is not None and len(lengths) and lengths.max() > cap:
        problems.append(f"{out / arrow}: a row of {lengths.max()} tokens exceeds --max-length {cap}")
    if len(docs) and (docs[0] < last_doc or np.any(np.diff(docs) < 0)):
        problems.append(f"{out / dfile}: doc_ids out of input order")
    if len(docs):
        last_doc = int(docs[-1])
    return problems, int(table.num_rows), int(lengths.sum()), last_doc


def verify(path: str | os.PathLike) -> list[str]:
    """Check an output folder: checksums and sizes of every file, rows and tokens per shard and in total, the
    lengths and doc_id index against the Arrow data, doc_ids in input order, no stray files. Returns the problems
    (empty = OK), each naming the file."""
    out = Path(path)
    try:
        m = load_manifest(out)
        check_manifest_structure(out, m)
        for entry in m["shards"]:  # never follow a name out of the folder
            for fn in entry["files"]:
                check_file_name(out, fn, str(out / MANIFEST_NAME))
    except DataError as exc:
        return [str(exc)]
    problems: list[str] = []
    rows = tokens = 0
    last_doc = -1
    expected = {MANIFEST_NAME, "state.json", "dataset_info.json"}
    max_len = m["options"].get("max_length")
    cap = max_len if max_len and m["options"].get("overflow") in ("split", "truncate") else None
    for entry in m["shards"]:
        expected.update(entry["files"])
        bad = verify_shard_files(out, entry)
        if bad:
            problems.append(bad)
            continue
        found, shard_rows, shard_tokens, last_doc = _check_shard(out, entry, cap, last_doc)
        problems.extend(found)
        rows += shard_rows
        tokens += shard_tokens
    c = m["counts"]
    if not problems and (rows != c["rows"] or tokens != c["tokens"]):
        problems.append(
            f"{out / MANIFEST_NAME}: counts say {c['rows']} rows / {c['tokens']} tokens, shards hold {rows} / {tokens}"
        )
    stray = sorted(n for n in os.listdir(out) if is_output_name(n) and n not in expected)
    problems.extend(f"{out / n}: unexpected file (not in the manifest)" for n in stray)
    return problems
