"""Pretokenized shards: the `balancer pretokenize` pipeline: the streaming shard writer, manifest, resume,
verify and merge. Inputs are read by `balancer.readers`, finished folders by `balancer.dataset` (`ShardDataset`,
`read_lengths`; re-exported here).

On-disk layout of an output folder (`balancer pretokenize ... --output DIR`)::

    DIR/shard-00000.arrow          Arrow IPC stream: input_ids list<uint16|int32>, doc_id int64 (one row per window)
    DIR/shard-00000.lengths.npy    int64 [rows]: tokens per row   (the lengths index: read without the tokens)
    DIR/shard-00000.doc_ids.npy    int64 [rows]: doc_id per row
    ...
    DIR/state.json, dataset_info.json   `datasets` metadata: `datasets.load_from_disk(DIR)` loads all shards as one
                                        Dataset; `datasets.Dataset.from_file(DIR/shard-00000.arrow)` loads one
    DIR/manifest.json              written last, atomically; its presence means the job is complete
    DIR/.pretokenize-state.json    progress while running (finished shards, input cursor); removed at the end

`doc_id` is the index of the source record in input order, counted over all inputs and over every record (also
the skipped ones, so it points back to the source: the line of a .jsonl, the row of a parquet file or dataset, the
file of a .txt); the windows of one split document share it. Rows come out in input order.

Resume: shards close only at document boundaries, once they hold at least `shard_tokens` tokens, so boundaries
depend only on the inputs and the options. Each shard is written under a temporary name, fsynced, renamed, and
then recorded (with its checksums and the input cursor after it) in the state file, atomically. A new run with
the same job verifies the recorded shards by checksum, deletes everything else, and continues from the cursor.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import multiprocessing as mp
import os
import re
import sys
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pyarrow as pa
from tqdm import tqdm

from .dataset import FORMAT_NAME, FORMAT_VERSION, MANIFEST_NAME, _open_arrow, load_manifest, shard_file_names
from .readers import (
    Cursor,
    PretokenizeError,
    _batched,
    cursor_for_record,
    fingerprint_input,
    iter_records,
    resolve_inputs,
    sha256_file,
)
from .tokenize import EncoderConfig, Tokenizer, TokenizerError, encode_payloads, init_encoder, load_tokenizer

# isort: split
# re-exported: older code imports these from balancer.shards
from .dataset import ShardDataset, read_lengths  # noqa: F401
from .readers import INPUT_SUFFIXES, READ_BATCH_BYTES, READ_BATCH_DOCS, InputSource, Record  # noqa: F401

STATE_NAME = ".pretokenize-state.json"
DEFAULT_SHARD_TOKENS = 100_000_000  # ~200 MB of uint16 ids per shard
FLUSH_TOKENS = 1 << 20  # Arrow record batch: at most ~1M tokens ...
FLUSH_ROWS = 4096  # ... or this many rows
MAX_SKIPPED_EXAMPLES = 100  # skipped records listed in the manifest (counts are always exact)
OVERFLOW_CHOICES = ("split", "truncate", "drop")
SKIP_REASONS = (
    "bad_json",
    "not_object",
    "missing_field",
    "not_text",
    "invalid_utf8",
    "unencodable_text",
    "empty",
    "blank_line",
    "too_long",
)
_SHARD_FILE_RE = re.compile(r"^shard-\d{5,}\.(arrow|lengths\.npy|doc_ids\.npy)$")


# ----------------------------------------------------------------------------------------------------------------
# small file helpers


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_json(path: Path, obj: Any) -> None:
    """Write `obj` as JSON to `path` via a temporary file, fsync and rename: readers see old or new, never half."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _save_npy(path: Path, arr: np.ndarray) -> None:
    with open(path, "wb") as f:
        np.save(f, np.ascontiguousarray(arr, dtype=np.int64), allow_pickle=False)


# ----------------------------------------------------------------------------------------------------------------
# encoder pool (the per-batch work is balancer.tokenize.encode_payloads, importable without torch/datasets)


def _encode_stream(
    batches: Iterator[tuple[list, list]], cfg: EncoderConfig, tok: Tokenizer, num_proc: int
) -> Iterator[tuple[list, tuple]]:
    """(meta, encode result) per batch, in input order; `num_proc` > 1 encodes in that many spawn workers with at
    most 2 * num_proc batches in flight (bounded memory)."""
    if num_proc <= 1:
        init_encoder(cfg, tok)
        for meta, payloads in batches:
            yield meta, encode_payloads(payloads)
        return
    ctx = mp.get_context("spawn")
    with ctx.Pool(num_proc, initializer=init_encoder, initargs=(cfg,)) as pool:
        pending: deque = deque()
        for meta, payloads in batches:
            pending.append((meta, pool.apply_async(encode_payloads, (payloads,))))
            if len(pending) >= 2 * num_proc:
                m, r = pending.popleft()
                yield m, r.get()
        while pending:
            m, r = pending.popleft()
            yield m, r.get()


# ----------------------------------------------------------------------------------------------------------------
# writer


def shard_features(dtype: np.dtype):
    """The `datasets.Features` of a shard."""
    import datasets

    return datasets.Features(
        {"input_ids": datasets.List(datasets.Value(np.dtype(dtype).name)), "doc_id": datasets.Value("int64")}
    )


class ShardWriter:
    """Streams rows into `DIR/shard-NNNNN.*` files written under temporary names; `close()` makes them final."""

    def __init__(self, out: Path, index: int, schema: pa.Schema, dtype: np.dtype) -> None:
        self.out = out
        self.name = f"shard-{index:05d}"
        self.schema = schema
        self.dtype = dtype
        self.arrow_name, self.lengths_name, self.doc_ids_name = shard_file_names(self.name)
        self.tmp = out / (self.arrow_name + ".tmp")
        self.sink = pa.OSFile(str(self.tmp), "wb")
        self.writer = pa.ipc.new_stream(self.sink, schema)
        self.buf_ids: list[np.ndarray] = []
        self.buf_docs: list[int] = []
        self.buf_tokens = 0
        self.all_lengths: list[np.ndarray] = []
        self.all_docs: list[np.ndarray] = []
        self.tokens = 0
        self.rows = 0
        self.documents = 0
        self._last_doc = -1

    def add(self, ids: np.ndarray, doc_id: int) -> None:
        """Append one row (a document or one window of it)."""
        self.buf_ids.append(ids)
        self.buf_docs.append(doc_id)
        self.buf_tokens += len(ids)
        self.tokens += len(ids)
        self.rows += 1
        if doc_id != self._last_doc:
            self.documents += 1
            self._last_doc = doc_id
        if self.buf_tokens >= FLUSH_TOKENS or len(self.buf_docs) >= FLUSH_ROWS:
            self._flush()

    def _flush(self) -> None:
        if not self.buf_docs:
            return
        lengths = np.fromiter((len(a) for a in self.buf_ids), dtype=np.int64, count=len(self.buf_ids))
        offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        values = np.concatenate(self.buf_ids).astype(self.dtype, copy=False)
        docs = np.asarray(self.buf_docs, dtype=np.int64)
        ids_arr = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
        batch = pa.RecordBatch.from_arrays([ids_arr, pa.array(docs)], schema=self.schema)
        self.writer.write_batch(batch)
        self.all_lengths.append(lengths)
        self.all_docs.append(docs)
        self.buf_ids, self.buf_docs, self.buf_tokens = [], [], 0

    def close(self) -> dict:
        """Finish the files, fsync, rename to final names; returns the shard's manifest entry."""
        self._flush()
        self.writer.close()
        self.sink.close()
        lengths = np.concatenate(self.all_lengths) if self.all_lengths else np.zeros(0, np.int64)
        docs = np.concatenate(self.all_docs) if self.all_docs else np.zeros(0, np.int64)
        tmp_l = self.out / (self.lengths_name + ".tmp")
        tmp_d = self.out / (self.doc_ids_name + ".tmp")
        _save_npy(tmp_l, lengths)
        _save_npy(tmp_d, docs)
        files = {}
        for tmp, final in ((self.tmp, self.arrow_name), (tmp_l, self.lengths_name), (tmp_d, self.doc_ids_name)):
            _fsync_file(tmp)
            files[final] = {"bytes": os.path.getsize(tmp), "sha256": sha256_file(tmp)}
            os.replace(tmp, self.out / final)
        return {
            "name": self.name,
            "rows": self.rows,
            "tokens": self.tokens,
            "documents": self.documents,
            "first_doc_id": int(docs[0]) if len(docs) else None,
            "last_doc_id": int(docs[-1]) if len(docs) else None,
            "max_length": int(lengths.max()) if len(lengths) else 0,
            "files": files,
        }

    def abort(self) -> None:
        try:
            self.writer.close()
            self.sink.close()
        except Exception:  # noqa: BLE001
            pass


# ----------------------------------------------------------------------------------------------------------------
# counters


def _new_counters() -> dict:
    return {
        "records": 0,
        "documents": 0,
        "rows": 0,
        "tokens": 0,
        "skipped": {},
        "dropped_tokens": 0,
        "truncated_documents": 0,
        "truncated_tokens": 0,
        "split_documents": 0,
        "skipped_examples": [],
    }


def _note_skip(counters: dict, reason: str, doc_id: int, where: str, message: str) -> None:
    counters["skipped"][reason] = counters["skipped"].get(reason, 0) + 1
    if len(counters["skipped_examples"]) < MAX_SKIPPED_EXAMPLES:
        counters["skipped_examples"].append({"doc_id": doc_id, "where": where, "reason": reason, "message": message})


# ----------------------------------------------------------------------------------------------------------------
# output folder


def _ours(name: str) -> bool:
    return (
        name in (MANIFEST_NAME, STATE_NAME, "state.json", "dataset_info.json")
        or name.endswith(".tmp")
        or bool(_SHARD_FILE_RE.match(name))
    )


def _clear_outputs(out: Path, keep: Iterable[str] = ()) -> None:
    keep = set(keep)
    for name in os.listdir(out):
        if name not in keep and _ours(name):
            os.remove(out / name)


def _load_json_file(path: Path) -> Optional[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def _prepare_output(out: Path, job: str, slice_: Optional[dict], overwrite: bool) -> tuple[str, Optional[dict]]:
    """('fresh'|'resume'|'complete', state or manifest). Refuses a folder holding something else."""
    if out.exists() and not out.is_dir():
        raise PretokenizeError(f"--output {out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    entries = os.listdir(out)
    if not entries:
        return "fresh", None
    manifest = _load_json_file(out / MANIFEST_NAME)
    state = _load_json_file(out / STATE_NAME)
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
    _clear_outputs(out)
    return "fresh", None


def _verify_shard_entry(out: Path, entry: dict) -> Optional[str]:
    """None when the shard's files exist and match their checksums, else the problem."""
    for fn, meta in entry["files"].items():
        p = out / fn
        if not p.is_file():
            return f"{p}: missing"
        if os.path.getsize(p) != meta["bytes"]:
            return f"{p}: size {os.path.getsize(p)} != {meta['bytes']} in the manifest"
        if sha256_file(p) != meta["sha256"]:
            return f"{p}: sha256 mismatch (file changed or corrupted)"
    return None


def _write_datasets_metadata(out: Path, shard_names: list[str], dtype: np.dtype, fingerprint: str) -> None:
    """state.json + dataset_info.json so that `datasets.load_from_disk(out)` loads every shard as one Dataset."""
    import datasets

    state = {
        "_data_files": [{"filename": f"{n}.arrow"} for n in shard_names],
        "_fingerprint": fingerprint[:16],
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }
    info = dataclasses.asdict(
        datasets.DatasetInfo(
            description="balancer pretokenize output: input_ids per row, doc_id = source record index",
            features=shard_features(dtype),
        )
    )
    atomic_write_json(out / "state.json", state)
    atomic_write_json(out / "dataset_info.json", {k: info[k] for k in sorted(info)})


# ----------------------------------------------------------------------------------------------------------------
# the pipeline


@dataclass
class PretokenizeOptions:
    """Options that decide the output bytes (all part of the job identity)."""

    text_field: str = "text"
    max_length: Optional[int] = None
    overflow: str = "split"
    add_eos: bool = False
    on_error: str = "fail"
    shard_tokens: int = DEFAULT_SHARD_TOKENS

    def check(self) -> None:
        if self.overflow not in OVERFLOW_CHOICES:
            raise PretokenizeError(f"--overflow must be one of {OVERFLOW_CHOICES}, got {self.overflow!r}")
        if self.on_error not in ("fail", "skip"):
            raise PretokenizeError(f"--on-error must be fail or skip, got {self.on_error!r}")
        if self.max_length is not None and self.max_length < 1:
            raise PretokenizeError(f"--max-length must be >= 1, got {self.max_length}")
        if self.shard_tokens < 1:
            raise PretokenizeError(f"--shard-tokens must be >= 1, got {self.shard_tokens}")


def _job_key(inputs: list[dict], tok: Tokenizer, opts: PretokenizeOptions) -> str:
    key = {
        "format": FORMAT_VERSION,
        "inputs": [[i["kind"], i["sha256"], i["records"]] for i in inputs],
        "tokenizer": tok.hash,
        "options": dataclasses.asdict(opts),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def pretokenize(
    inputs: Sequence[str],
    output: str | os.PathLike,
    tokenizer: str = "byte",
    options: Optional[PretokenizeOptions] = None,
    num_proc: int = 1,
    num_shards: int = 1,
    shard_index: int = 0,
    overwrite: bool = False,
    progress: Optional[bool] = None,
) -> dict:
    """Tokenize `inputs` into shards under `output`; returns the manifest. Resumes a killed run of the same job.

    Raises PretokenizeError for bad input (naming the file and line) when `on_error='fail'`, for a refused output
    folder, and for bad options; then no manifest is written. `progress=None` shows bars only on a terminal."""
    opts = options or PretokenizeOptions()
    opts.check()
    if num_proc < 1:
        raise PretokenizeError(f"--num-proc must be >= 1, got {num_proc}")
    if num_shards < 1 or not 0 <= shard_index < num_shards:
        raise PretokenizeError(f"--shard-index must be in [0, --num-shards), got {shard_index} of {num_shards}")
    out = Path(output)
    disable = None if progress is None else not progress
    sources, ignored = resolve_inputs(list(inputs), exclude=out)
    try:
        tok = load_tokenizer(tokenizer)
    except TokenizerError as exc:
        raise PretokenizeError(str(exc)) from exc
    if opts.add_eos and tok.eos_id is None:
        raise PretokenizeError(f"--add-eos: tokenizer {tokenizer!r} has no eos_token")

    total_bytes = sum(os.path.getsize(s.path) for s in sources if s.kind not in ("hf_disk", "hf_hub"))
    with tqdm(
        total=total_bytes, unit="B", unit_scale=True, desc="hashing inputs", disable=disable, file=sys.stderr
    ) as bar:
        infos = [fingerprint_input(s, bar) for s in sources]
    job = _job_key(infos, tok, opts)
    total_records = sum(i["records"] for i in infos)
    start = shard_index * total_records // num_shards
    end = (shard_index + 1) * total_records // num_shards
    slice_ = (
        None if num_shards == 1 else {"num_shards": num_shards, "shard_index": shard_index, "records": [start, end]}
    )

    status, prev = _prepare_output(out, job, slice_, overwrite)
    if status == "complete":
        if (out / STATE_NAME).exists():  # killed between writing the manifest and removing the state file
            os.remove(out / STATE_NAME)
        problems = verify(out)
        if problems:
            raise PretokenizeError(
                f"{out} holds this job's finished output but it fails verification: "
                f"{problems[0]}; pass --overwrite to redo it"
            )
        _log(f"{out}: already complete ({prev['counts']['rows']} rows, {prev['counts']['tokens']} tokens)")
        return prev

    shards: list[dict] = []
    counters = _new_counters()
    cursor = cursor_for_record(start, infos)
    if status == "resume":
        for entry in prev["shards"]:
            if _verify_shard_entry(out, entry) is not None:
                break
            shards.append(entry)
        if shards:
            cursor = Cursor.from_json(shards[-1]["cursor"])
            counters = json.loads(json.dumps(shards[-1]["counters"]))
        _log(f"{out}: resuming after {len(shards)} finished shard(s) at record {cursor.record}")
    keep = {fn for e in shards for fn in e["files"]}
    _clear_outputs(out, keep=keep | {STATE_NAME})
    state = {"job": job, "slice": slice_, "shards": shards}
    atomic_write_json(out / STATE_NAME, state)

    schema = shard_features(tok.dtype).arrow_schema
    cfg = EncoderConfig(tokenizer, tok.hash, opts.text_field, opts.add_eos)
    writer: Optional[ShardWriter] = None
    max_len = opts.max_length

    def close_shard(cur: Cursor) -> None:
        nonlocal writer
        assert writer is not None
        entry = writer.close()
        writer = None
        counters["rows"] += entry["rows"]
        counters["tokens"] += entry["tokens"]
        counters["documents"] += entry["documents"]
        entry["cursor"] = cur.to_json()
        entry["counters"] = json.loads(json.dumps(counters))
        shards.append(entry)
        atomic_write_json(out / STATE_NAME, state)

    records = iter_records(sources, opts.text_field, cursor, end)
    bar = tqdm(
        total=end - start,
        initial=cursor.record - start,
        unit="doc",
        desc="pretokenize",
        disable=disable,
        file=sys.stderr,
        smoothing=0.1,
    )
    try:
        for meta, (lengths, flat, errors) in _encode_stream(_batched(records), cfg, tok, num_proc):
            offs = np.zeros(len(lengths) + 1, dtype=np.int64)
            np.cumsum(np.maximum(lengths, 0), out=offs[1:])
            for j, (doc_id, where, cur) in enumerate(meta):
                counters["records"] += 1
                n = int(lengths[j])
                if n < 0:
                    reason, message = errors[j]
                    if reason not in ("empty", "blank_line") and opts.on_error == "fail":
                        raise PretokenizeError(f"{where}: {message} (use --on-error skip to skip such records)")
                    _note_skip(counters, reason, doc_id, where, message)
                else:
                    ids = flat[offs[j] : offs[j + 1]]
                    if max_len is not None and n > max_len:
                        if opts.overflow == "drop":
                            _note_skip(counters, "too_long", doc_id, where, f"{n} tokens > --max-length {max_len}")
                            counters["dropped_tokens"] += n
                            ids = None
                        elif opts.overflow == "truncate":
                            counters["truncated_documents"] += 1
                            counters["truncated_tokens"] += n - max_len
                            ids = ids[:max_len]
                        else:
                            counters["split_documents"] += 1
                    if ids is not None:
                        if writer is None:
                            writer = ShardWriter(out, len(shards), schema, tok.dtype)
                        for a in range(0, len(ids), max_len or len(ids)):
                            writer.add(ids[a : a + (max_len or len(ids))], doc_id)
                if writer is not None and writer.tokens >= opts.shard_tokens:
                    close_shard(cur)
            bar.update(len(meta))
        if writer is not None:
            close_shard(Cursor(end, len(sources), 0, None))
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    finally:
        bar.close()

    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "balancer_version": _version(),
        "job": job,
        "slice": slice_,
        "tokenizer": {**tok.describe(), "spec": tokenizer},
        "options": dataclasses.asdict(opts),
        "inputs": infos,
        "ignored_files": ignored,
        "features": {"input_ids": f"list<{np.dtype(tok.dtype).name}>", "doc_id": "int64"},
        "counts": {k: v for k, v in counters.items() if k != "skipped_examples"},
        "skipped_records": counters["skipped_examples"],
        "shards": [{k: v for k, v in e.items() if k not in ("cursor", "counters")} for e in shards],
    }
    _finish(out, manifest, tok.dtype)
    _summary(out, manifest)
    return manifest


def _finish(out: Path, manifest: dict, dtype: np.dtype) -> None:
    """datasets metadata, then manifest.json (atomic, last), then drop the state file."""
    names = [s["name"] for s in manifest["shards"]]
    if names:
        _write_datasets_metadata(out, names, dtype, manifest["job"])
    atomic_write_json(out / MANIFEST_NAME, manifest)
    try:
        os.remove(out / STATE_NAME)
    except FileNotFoundError:
        pass


def _summary(out: Path, manifest: dict) -> None:
    c = manifest["counts"]
    _log(
        f"{out}: {len(manifest['shards'])} shard(s), {c['documents']} documents, {c['rows']} rows, "
        f"{c['tokens']} tokens from {c['records']} records"
    )
    if c["skipped"]:
        _log(
            "skipped: "
            + ", ".join(f"{k}={v}" for k, v in sorted(c["skipped"].items()))
            + (
                f" (first: {manifest['skipped_records'][0]['where']}: {manifest['skipped_records'][0]['message']})"
                if manifest["skipped_records"]
                else ""
            )
        )
    if c["truncated_documents"]:
        _log(f"truncated: {c['truncated_documents']} documents lost {c['truncated_tokens']} tokens")


def _version() -> str:
    from .. import __version__

    return __version__


# ----------------------------------------------------------------------------------------------------------------
# verify


def verify(path: str | os.PathLike) -> list[str]:
    """Check an output folder: checksums and sizes of every file, rows and tokens per shard and in total, the
    lengths and doc_id index against the Arrow data, doc_ids in input order, no stray files. Returns the problems
    (empty = OK), each naming the file."""
    out = Path(path)
    try:
        m = load_manifest(out)
    except PretokenizeError as exc:
        return [str(exc)]
    problems: list[str] = []
    rows = tokens = 0
    last_doc = -1
    expected = {MANIFEST_NAME, "state.json", "dataset_info.json"}
    max_len = m["options"].get("max_length")
    cap = max_len if max_len and m["options"].get("overflow") in ("split", "truncate") else None
    for entry in m["shards"]:
        expected.update(entry["files"])
        bad = _verify_shard_entry(out, entry)
        if bad:
            problems.append(bad)
            continue
        arrow, lfile, dfile = shard_file_names(entry["name"])
        try:
            table = _open_arrow(out / arrow)
            col = table.column("input_ids")
            lengths = (
                np.concatenate([np.diff(c.offsets.to_numpy()) for c in col.chunks])
                if col.num_chunks
                else np.zeros(0, np.int64)
            )
            docs = table.column("doc_id").to_numpy()
        except Exception as exc:  # noqa: BLE001
            problems.append(f"{out / arrow}: unreadable Arrow data ({type(exc).__name__}: {exc})")
            continue
        L = np.load(out / lfile, allow_pickle=False)
        D = np.load(out / dfile, allow_pickle=False)
        if table.num_rows != entry["rows"]:
            problems.append(f"{out / arrow}: {table.num_rows} rows, manifest says {entry['rows']}")
        if not np.array_equal(L, lengths):
            problems.append(f"{out / lfile}: lengths index differs from the token data in {arrow}")
        if not np.array_equal(D, docs):
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
        rows += int(table.num_rows)
        tokens += int(lengths.sum())
    c = m["counts"]
    if not problems and (rows != c["rows"] or tokens != c["tokens"]):
        problems.append(
            f"{out / MANIFEST_NAME}: counts say {c['rows']} rows / {c['tokens']} tokens, shards hold {rows} / {tokens}"
        )
    stray = sorted(n for n in os.listdir(out) if _ours(n) and n not in expected)
    problems.extend(f"{out / n}: unexpected file (not in the manifest)" for n in stray)
    return problems


# ----------------------------------------------------------------------------------------------------------------
# merge


def merge(parts: Sequence[str], output: str | os.PathLike, overwrite: bool = False) -> dict:
    """Join the outputs of `--num-shards K --shard-index i` runs (all K, any order) into one folder whose rows
    equal a single run's (shard boundaries may differ). Files are hard-linked when possible, else copied; each is
    checked against its part's checksum. Returns the merged manifest."""
    if not parts:
        raise PretokenizeError("merge: no input folders")
    mans = [(p, load_manifest(p)) for p in parts]
    first = mans[0][1]
    for p, m in mans:
        if m.get("slice") is None:
            raise PretokenizeError(f"merge: {p} is not a --num-shards slice")
        for key in ("job", "tokenizer", "options"):
            if m[key] != first[key]:
                raise PretokenizeError(
                    f"merge: {p} differs from {mans[0][0]} in {key} (different inputs, tokenizer or options)"
                )
    k = first["slice"]["num_shards"]
    by_index: dict[int, tuple[str, dict]] = {}
    for p, m in mans:
        if m["slice"]["num_shards"] != k:
            raise PretokenizeError(f"merge: {p} is a slice of {m['slice']['num_shards']}, others of {k}")
        i = m["slice"]["shard_index"]
        if i in by_index:
            raise PretokenizeError(f"merge: {p} and {by_index[i][0]} are both slice {i}")
        by_index[i] = (p, m)
    missing = sorted(set(range(k)) - set(by_index))
    if missing:
        raise PretokenizeError(f"merge: missing slice(s) {missing} of {k}")
    out = Path(output)
    status, prev = _prepare_output(out, first["job"], None, overwrite)
    if status == "complete":
        _log(f"{out}: already complete")
        return prev
    _clear_outputs(out)
    atomic_write_json(out / STATE_NAME, {"job": first["job"], "slice": None, "shards": []})
    counts = _new_counters()
    del counts["skipped_examples"]
    skipped: list = []
    shards: list[dict] = []
    for i in range(k):
        p, m = by_index[i]
        for key, v in m["counts"].items():
            if key == "skipped":
                for r, n in v.items():
                    counts["skipped"][r] = counts["skipped"].get(r, 0) + n
            else:
                counts[key] += v
        skipped.extend(m["skipped_records"][: MAX_SKIPPED_EXAMPLES - len(skipped)])
        for entry in m["shards"]:
            new = dict(entry)
            new["name"] = f"shard-{len(shards):05d}"
            new["files"] = {}
            for old_fn, new_fn in zip(shard_file_names(entry["name"]), shard_file_names(new["name"])):
                src = Path(p) / old_fn
                meta = entry["files"][old_fn]
                tmp = out / (new_fn + ".tmp")
                try:
                    os.link(src, tmp)
                except OSError:
                    import shutil

                    shutil.copyfile(src, tmp)
                if sha256_file(tmp) != meta["sha256"]:
                    os.remove(tmp)
                    raise PretokenizeError(f"merge: {src}: sha256 mismatch (run `balancer verify {p}`)")
                os.replace(tmp, out / new_fn)
                new["files"][new_fn] = meta
            shards.append(new)
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
    dtype = np.dtype(first["tokenizer"]["dtype"])
    _finish(out, manifest, dtype)
    _summary(out, manifest)
    return manifest
