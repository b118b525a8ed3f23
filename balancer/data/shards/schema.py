"""The exact shape of every JSON file the data commands write and read back: the manifests and run states of
`pretokenize`/`merge` and of `pack`, checked with `balancer.strict_json` (exact types: a boolean is `true`/`false`,
an integer is not a boolean; unknown or misspelt keys refused; integers in int64 or narrower ranges; `format` and
`format_version` known, older versions still read). `load_record(path, kind)` reads one, DataError naming the file
and the key.

Versions: a pretokenized manifest is version 1; a pack manifest version 1; run states carry `format`/
`format_version` since version 1 of their own formats (a state written before that, without them, still loads).
"""

from __future__ import annotations

import os
from typing import Any

from balancer.data.shards.errors import DataError
from balancer.limits import MAX_EPOCHS, MAX_LENGTH, MAX_NUM_SHARDS, MAX_PACK_SEED, MAX_SHARD_TOKENS
from balancer.strict_json import FORMAT_KEYS as OPTIONAL_FORMAT_KEYS
from balancer.strict_json import (
    FormatSpec,
    JSONFileError,
    anything,
    array,
    boolean,
    check,
    check_format,
    integer,
    load_json,
    obj,
    string,
)

COUNT = integer(min=0)
SHA256 = string()
VOCAB_MAX = 2**31 - 1
TOKEN_DTYPES = ("uint16", "int32")


def _file_meta() -> Any:
    return obj({"bytes": COUNT, "sha256": SHA256, "crc32": integer(min=0, max=2**32 - 1, required=False)})


FILES = obj()  # name -> file meta, names checked by the readers; values below
_FILE_META = _file_meta()

PRETOKENIZED = FormatSpec("balancer-pretokenized", 1)
PRETOKENIZE_STATE = FormatSpec("balancer-pretokenize-state", 2)  # 2: `pending`
PACKED = FormatSpec("balancer-packed", 1)
PACK_STATE = FormatSpec("balancer-pack-state", 2)  # 2: `pending`
FORMAT_KEYS = {"format": string(), "format_version": integer(min=1)}  # manifests: both required
# states: both optional (a state written before format_version still loads)

TOKENIZER = obj(
    {
        "name": string(),
        "spec": string(),
        "hash": SHA256,
        "vocab_size": integer(min=1, max=VOCAB_MAX),
        "eos_id": integer(min=0, max=VOCAB_MAX - 1, nullable=True),
        "dtype": string(choices=TOKEN_DTYPES),
    }
)
OPTIONS = obj(
    {
        "text_field": string(),
        "max_length": integer(min=1, max=MAX_LENGTH, nullable=True),
        "overflow": string(choices=("split", "truncate", "drop")),
        "add_eos": boolean(),
        "on_error": string(choices=("fail", "skip")),
        "shard_tokens": integer(min=1, max=MAX_SHARD_TOKENS),
    }
)
INPUT = obj(
    {
        "path": string(),
        "kind": string(choices=("jsonl", "json_array", "parquet", "txt", "hf_disk", "hf_hub")),
        "size": COUNT,
        "sha256": SHA256,
        "records": COUNT,
        "compression": string(required=False),
        "decompressed_size": integer(min=0, required=False),
    }
)
_COUNTS_KEYS = {
    "records": COUNT,
    "documents": COUNT,
    "rows": COUNT,
    "tokens": COUNT,
    "skipped": obj(),
    "dropped_tokens": COUNT,
    "truncated_documents": COUNT,
    "truncated_tokens": COUNT,
    "split_documents": COUNT,
}
SKIPPED_RECORD = obj({"doc_id": COUNT, "where": string(), "reason": string(), "message": string()})
_SHARD_KEYS = {
    "name": string(),
    "rows": COUNT,
    "tokens": COUNT,
    "documents": COUNT,
    "first_doc_id": integer(min=0, nullable=True),
    "last_doc_id": integer(min=0, nullable=True),
    "max_length": integer(min=0, max=MAX_LENGTH),
    "files": FILES,
}
SHARD = obj(_SHARD_KEYS)
SLICE = obj(
    {
        "num_shards": integer(min=1, max=MAX_NUM_SHARDS),
        "shard_index": integer(min=0, max=MAX_NUM_SHARDS - 1),
        "records": array(COUNT),
    },
    nullable=True,
)
ENGINE = obj(
    {"name": string(choices=("local", "ray")), "ray_version": string(required=False), "address": string(required=False)}
)
MANIFEST_KEYS = {
    **FORMAT_KEYS,
    "balancer_version": string(),
    "job": SHA256,
    "slice": SLICE,
    "tokenizer": TOKENIZER,
    "options": OPTIONS,
    "inputs": array(INPUT),
    "ignored_files": array(string()),
    "features": obj({"input_ids": string(), "doc_id": string()}),
    "counts": obj(_COUNTS_KEYS),
    "skipped_records": array(SKIPPED_RECORD),
    "shards": array(SHARD),
    "engine": ENGINE,
    "merged_from": array(string(), required=False),
}
CURSOR = obj({"record": COUNT, "input": COUNT, "local": COUNT, "offset": integer(min=0, nullable=True)})
STATE_SHARD = obj(
    {
        **_SHARD_KEYS,
        "cursor": CURSOR,
        "counters": obj({**_COUNTS_KEYS, "skipped_examples": array(SKIPPED_RECORD)}),
    }
)
PENDING = array(obj({"name": string(), "files": FILES}), required=False, since=2)
STATE_KEYS = {
    **OPTIONAL_FORMAT_KEYS,
    "job": SHA256,
    "slice": SLICE,
    "inputs": array(INPUT, required=False),
    "shards": array(STATE_SHARD),
    "pending": PENDING,
    "journal": string(required=False),  # the id of the journal that holds the shards recorded since (journal.py)
}

PLAN_ENTRY = obj({"name": string(), "files": FILES})
PACK_SHARD = obj({"name": string(), "first_row": COUNT, "rows": COUNT, "tokens": COUNT, "files": FILES})
PACK_EPOCH = obj(
    {
        "epoch": integer(min=0, max=MAX_EPOCHS),
        "seed": integer(min=0),
        "plan": string(),
        "steps": COUNT,
        "rows": COUNT,
        "tokens": COUNT,
        "metrics": anything(),
    }
)
PACK_MANIFEST_KEYS = {
    **FORMAT_KEYS,
    "balancer_version": string(),
    "job": SHA256,
    "source": obj(
        {"path": string(), "manifest_sha256": SHA256, "rows": COUNT, "tokens": COUNT, "tokenizer": anything()}
    ),
    "topology": obj(),
    "cost_model": obj(),
    "options": obj(
        {
            "epochs": integer(min=1, max=MAX_EPOCHS),
            "seed": integer(min=0, max=MAX_PACK_SEED),
            "overflow": string(choices=("error", "split", "truncate")),
            "shard_tokens": integer(min=1, max=MAX_SHARD_TOKENS),
        }
    ),
    "features": obj(),
    "epochs": array(PACK_EPOCH, max_items=MAX_EPOCHS),
    "counts": obj({"rows": COUNT, "tokens": COUNT, "dropped_tokens": COUNT}),
    "plans": array(PLAN_ENTRY),
    "shards": array(PACK_SHARD),
}
PACK_STATE_KEYS = {
    **OPTIONAL_FORMAT_KEYS,
    "job": SHA256,
    "plans": array(PLAN_ENTRY),
    "shards": array(PACK_SHARD),
    "pending": PENDING,
    "journal": string(required=False),  # as in STATE_KEYS
}

KINDS = {
    "manifest": (PRETOKENIZED, MANIFEST_KEYS, True),
    "state": (PRETOKENIZE_STATE, STATE_KEYS, False),
    "pack_manifest": (PACKED, PACK_MANIFEST_KEYS, True),
    "pack_state": (PACK_STATE, PACK_STATE_KEYS, False),
}


def _check_file_maps(data: dict, file: str, lists: tuple[str, ...]) -> None:
    for key in lists:
        for i, entry in enumerate(data.get(key, [])):
            for name, meta in entry["files"].items():
                check(meta, _FILE_META, file, f"{key}[{i}].files.{name}")


def check_record(data: Any, file: str, kind: str) -> dict:
    """`data` (a parsed manifest or state of `kind`) when it has exactly the shape of its format; DataError
    naming the file and key otherwise."""
    spec, keys, format_required = KINDS[kind]
    try:
        version = check_format(data, file, spec, required=format_required)
        check(data, obj(keys), file, version=version)
        _check_file_maps(data, file, ("plans", "shards", "pending"))
        for name, value in (data.get("counts") or {}).get("skipped", {}).items():
            check(value, COUNT, file, f"counts.skipped.{name}")
    except JSONFileError as exc:
        raise DataError(str(exc)) from None
    return data


def load_record(path: str | os.PathLike, kind: str) -> dict:
    """Read and check one manifest or state file (see `check_record`); DataError naming the file and key."""
    try:
        data = load_json(path)
    except JSONFileError as exc:
        raise DataError(str(exc)) from None
    return check_record(data, os.fspath(path), kind)


def state_header(kind: str) -> dict:
    """The `format` / `format_version` keys a state file of `kind` starts with."""
    return KINDS[kind][0].header()
