"""`verify`: the full check of a finished pretokenized folder (every byte of every file)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import numpy as np

from balancer.data.shards.arrow_rows import open_arrow
from balancer.data.shards.checks import check_file_name, check_files_inside, check_manifest_structure, check_shard_index
from balancer.data.shards.errors import DataError
from balancer.data.shards.manifest import MANIFEST_NAME, load_manifest, shard_file_names, verify_shard_files
from balancer.data.shards.output import is_output_name


def _row_lengths(table) -> np.ndarray:
    col = table.column("input_ids")
    if not col.num_chunks:
        return np.zeros(0, np.int64)
    return np.concatenate([np.diff(c.offsets.to_numpy()) for c in col.chunks])


def _check_token_types(out: Path, arrow: str, table, tokenizer: dict) -> list[str]:
    """The Arrow columns' types against the manifest's tokenizer dtype, and every id below its vocabulary."""
    problems = []
    ids_type = table.schema.field("input_ids").type
    value_type = str(getattr(ids_type, "value_type", ids_type))
    if value_type != tokenizer["dtype"]:
        problems.append(
            f"{out / arrow}: token ids are {value_type}, the manifest's tokenizer.dtype is {tokenizer['dtype']}"
        )
    elif table.num_rows:
        values = [c.values.to_numpy() for c in table.column("input_ids").chunks if len(c.values)]
        top = max((int(v.max()) for v in values), default=-1)
        low = min((int(v.min()) for v in values), default=0)
        if top >= tokenizer["vocab_size"] or low < 0:
            problems.append(
                f"{out / arrow}: token id {top if top >= tokenizer['vocab_size'] else low} is outside the "
                f"vocabulary [0, {tokenizer['vocab_size']}) of the manifest's tokenizer"
            )
    if str(table.schema.field("doc_id").type) != "int64":
        problems.append(f"{out / arrow}: doc_id column is {table.schema.field('doc_id').type}, expected int64")
    return problems


def _check_shard(
    out: Path, entry: dict, cap: Optional[int], last_doc: int, tokenizer: dict
) -> tuple[list[str], int, int, int]:
    """(problems, rows, tokens, last doc_id) of one shard whose files match their checksums."""
    arrow, lfile, dfile = shard_file_names(entry["name"])
    try:
        table = open_arrow(out / arrow)
        lengths = _row_lengths(table)
        docs = table.column("doc_id").to_numpy()
    except Exception as exc:  # noqa: BLE001
        return [f"{out / arrow}: unreadable Arrow data ({type(exc).__name__}: {exc})"], 0, 0, last_doc
    problems: list[str] = _check_token_types(out, arrow, table, tokenizer)
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


def _check_manifest_values(out: Path, m: dict) -> None:
    """What the schema cannot say alone: the tokenizer's dtype fits its vocabulary, EOS inside it, the features
    name the dtype, the counts agree with each other."""
    where = out / MANIFEST_NAME
    tok = m["tokenizer"]
    dtype = "uint16" if tok["vocab_size"] <= 65536 else "int32"
    if tok["dtype"] != dtype:
        raise DataError(
            f"{where}: tokenizer.dtype {tok['dtype']} but a vocabulary of {tok['vocab_size']} is stored as {dtype}"
        )
    if tok["eos_id"] is not None and tok["eos_id"] >= tok["vocab_size"]:
        raise DataError(f"{where}: tokenizer.eos_id {tok['eos_id']} is outside the vocabulary ({tok['vocab_size']})")
    if m["features"] != {"input_ids": f"list<{dtype}>", "doc_id": "int64"}:
        raise DataError(f"{where}: features {m['features']} disagree with tokenizer.dtype {tok['dtype']}")
    c = m["counts"]
    if c["documents"] > c["rows"] or c["documents"] + sum(c["skipped"].values()) > c["records"]:
        raise DataError(
            f"{where}: counts disagree (documents {c['documents']}, rows {c['rows']}, records {c['records']})"
        )


def _open_checks(out: Path, m: dict) -> tuple[list[str], int, int]:
    """The checks every reader runs on open (`open_folder`), as problems; with the number of distinct doc_ids in
    the shards (windows of one document share one) and the last doc_id."""
    last_doc, distinct = -1, 0
    for entry in m["shards"]:
        try:
            check_files_inside(out, entry)
            _, doc_ids = check_shard_index(out, entry, last_doc)
        except DataError as exc:
            return [str(exc)], 0, -1
        if len(doc_ids):
            distinct += int(np.count_nonzero(np.diff(doc_ids))) + int(int(doc_ids[0]) != last_doc)
            last_doc = int(doc_ids[-1])
    return [], distinct, last_doc


def _record_accounting(out: Path, m: dict, documents: int, last_doc: int) -> list[str]:
    """The record counts against each other and the shards, so that an edit of one count (or of several kept
    consistent with each other) is caught: every record read became a document or was skipped; the documents are
    the distinct doc_ids in the shards; every doc_id and skipped record lies in the records read; the list of
    skipped records holds the first min(100, skipped) of them; without a slice the inputs' records add up."""
    where, c = out / MANIFEST_NAME, m["counts"]
    skipped = sum(c["skipped"].values())
    first = m["slice"]["records"][0] if m["slice"] else 0
    problems = []
    if c["documents"] + skipped != c["records"]:
        problems.append(f"documents {c['documents']} + skipped {skipped} != records read {c['records']}")
    if c["documents"] != documents:
        problems.append(f"counts.documents is {c['documents']}, but the shards hold {documents} distinct doc_ids")
    if last_doc >= first + c["records"]:
        problems.append(f"the shards hold doc_id {last_doc}, beyond the {c['records']} records read from {first}")
    listed = m["skipped_records"]
    if len(listed) != min(100, skipped):
        problems.append(f"skipped_records lists {len(listed)} records, but {skipped} were skipped (it keeps <= 100)")
    bad = [r["doc_id"] for r in listed if not first <= r["doc_id"] < first + c["records"]]
    if bad:
        problems.append(f"skipped_records names doc_id {bad[0]}, outside the records read")
    for key in ("split_documents", "truncated_documents"):
        if c[key] > c["documents"]:
            problems.append(f"counts.{key} {c[key]} exceeds the {c['documents']} documents")
    if c["split_documents"] == 0 and c["rows"] != c["documents"]:
        problems.append(f"{c['rows']} rows for {c['documents']} documents, but no document was split")
    if m["slice"] is None and "merged_from" not in m and sum(i["records"] for i in m["inputs"]) != c["records"]:
        problems.append(f"the inputs hold {sum(i['records'] for i in m['inputs'])} records, counts say {c['records']}")
    return [f"{where}: record accounting: {p}" for p in problems]


def verify(path: str | os.PathLike) -> list[str]:
    """Check an output folder: checksums and sizes of every file, rows and tokens per shard and in total, the
    lengths and doc_id index against the Arrow data, doc_ids in input order, no stray files. Returns the problems
    (empty = OK), each naming the file."""
    out = Path(path)
    try:
        m = load_manifest(out)  # strict JSON: types, keys, ranges, format_version
        check_manifest_structure(out, m)
        _check_manifest_values(out, m)
        for entry in m["shards"]:  # never follow a name out of the folder
            for fn in entry["files"]:
                check_file_name(out, fn, str(out / MANIFEST_NAME))
    except DataError as exc:
        return [str(exc)]
    problems, documents, final_doc = _open_checks(out, m)
    if problems:  # the readers refuse this folder: say why (the byte checks below would repeat it)
        return problems
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
        found, shard_rows, shard_tokens, last_doc = _check_shard(out, entry, cap, last_doc, m["tokenizer"])
        problems.extend(found)
        rows += shard_rows
        tokens += shard_tokens
    c = m["counts"]
    if not problems and (rows != c["rows"] or tokens != c["tokens"]):
        problems.append(
            f"{out / MANIFEST_NAME}: counts say {c['rows']} rows / {c['tokens']} tokens, shards hold {rows} / {tokens}"
        )
    problems.extend(_record_accounting(out, m, documents, final_doc))
    stray = sorted(n for n in os.listdir(out) if is_output_name(n) and n not in expected)
    problems.extend(f"{out / n}: unexpected file (not in the manifest)" for n in stray)
    return problems


def require_verified(path: str | os.PathLike) -> None:
    """`verify`, raising DataError with the first problem (and how many more) instead of returning the list."""
    problems = verify(path)
    if problems:
        more = f" (and {len(problems) - 1} more; run `balancer verify {path}`)" if len(problems) > 1 else ""
        raise DataError(problems[0] + more)
