"""Pretokenized shards: input readers, the streaming shard writer, manifest, resume, verify, merge, and the reader
(`ShardDataset`, `read_lengths`).

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

import bisect
import dataclasses
import hashlib
import json
import multiprocessing as mp
import os
import re
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence

import numpy as np
import pyarrow as pa
import torch
from tqdm import tqdm

from .tokenize import EncoderConfig, Tokenizer, TokenizerError, encode_payloads, init_encoder, load_tokenizer

FORMAT_NAME = "balancer-pretokenized"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
STATE_NAME = ".pretokenize-state.json"
DEFAULT_SHARD_TOKENS = 100_000_000   # ~200 MB of uint16 ids per shard
FLUSH_TOKENS = 1 << 20                # Arrow record batch: at most ~1M tokens ...
FLUSH_ROWS = 4096                     # ... or this many rows
READ_BATCH_DOCS = 1024                # documents per tokenization batch ...
READ_BATCH_BYTES = 4 << 20            # ... or this many bytes of raw text
MAX_SKIPPED_EXAMPLES = 100            # skipped records listed in the manifest (counts are always exact)
INPUT_SUFFIXES = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".txt": "txt"}
OVERFLOW_CHOICES = ("split", "truncate", "drop")
SKIP_REASONS = ("bad_json", "not_object", "missing_field", "not_text", "invalid_utf8", "unencodable_text",
                "empty", "blank_line", "too_long")
_SHARD_FILE_RE = re.compile(r"^shard-\d{5,}\.(arrow|lengths\.npy|doc_ids\.npy)$")


class PretokenizeError(RuntimeError):
    """A run cannot proceed: bad input (the message names the file and line), a refused output folder, ..."""


# ----------------------------------------------------------------------------------------------------------------
# small file helpers

def sha256_file(path: Path, chunk: int = 1 << 23) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                return h.hexdigest()
            h.update(b)


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
# inputs

@dataclass(frozen=True)
class InputSource:
    """One input: `kind` in jsonl | json_array | parquet | txt | hf_disk | hf_hub; `path` as a string."""

    kind: str
    path: str

    @property
    def display(self) -> str:
        return self.path


def _sniff_json(path: Path) -> str:
    """`.json` files: a top-level array -> json_array, else JSON lines."""
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    return "json_array" if head.startswith(b"[") else "jsonl"


def _source_for_file(p: Path) -> Optional[InputSource]:
    kind = INPUT_SUFFIXES.get(p.suffix.lower())
    if kind is None:
        return None
    if kind == "json":
        kind = _sniff_json(p)
    return InputSource(kind, str(p))


def resolve_inputs(specs: Sequence[str], exclude: Optional[Path] = None) -> tuple[list[InputSource], list[str]]:
    """Expand INPUT arguments into sources, in command-line order (directory contents sorted by relative path).

    Returns (sources, ignored files found in directories). Raises PretokenizeError for a missing path, an
    unsupported file type or a directory without inputs. A path that does not exist and does not look like a file
    path is taken as a Hugging Face hub dataset name. Files under `exclude` (the output folder) are skipped."""
    excl = exclude.resolve() if exclude is not None else None
    sources: list[InputSource] = []
    ignored: list[str] = []
    if not specs:
        raise PretokenizeError("no INPUT given")
    for spec in specs:
        p = Path(spec)
        if p.is_dir():
            if (p / "state.json").is_file() and (p / "dataset_info.json").is_file() or \
                    (p / "dataset_dict.json").is_file():
                sources.append(InputSource("hf_disk", spec))
                continue
            found = []
            for f in sorted(p.rglob("*"), key=lambda q: q.relative_to(p).as_posix()):
                if not f.is_file() or any(part.startswith(".") for part in f.relative_to(p).parts):
                    continue
                if excl is not None and (excl == f.resolve().parent or excl in f.resolve().parents):
                    continue
                src = _source_for_file(f)
                if src is None:
                    ignored.append(str(f))
                else:
                    found.append(src)
            if not found:
                raise PretokenizeError(f"{spec}: directory holds no .jsonl/.json/.parquet/.txt files")
            sources.extend(found)
        elif p.is_file():
            src = _source_for_file(p)
            if src is None:
                raise PretokenizeError(f"{spec}: unsupported input type {p.suffix!r} "
                                       f"(expected .jsonl, .json, .parquet, .txt, a directory or a dataset name)")
            sources.append(src)
        elif p.suffix.lower() in INPUT_SUFFIXES or spec.startswith((".", "/", "~")) or os.sep + os.sep in spec:
            raise PretokenizeError(f"{spec}: no such file or directory")
        else:
            sources.append(InputSource("hf_hub", spec))
    return sources, ignored


def _load_hf(source: InputSource):
    """The `datasets.Dataset` of an hf_disk / hf_hub source (a DatasetDict contributes its 'train' split)."""
    import datasets
    try:
        if source.kind == "hf_disk":
            ds = datasets.load_from_disk(source.path)
        else:
            ds = datasets.load_dataset(source.path, split="train")
    except Exception as exc:
        raise PretokenizeError(f"{source.path}: cannot load with `datasets` ({type(exc).__name__}: {exc})") from exc
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise PretokenizeError(f"{source.path}: a DatasetDict without a 'train' split (splits: {list(ds)})")
        ds = ds["train"]
    return ds


def fingerprint_input(source: InputSource, progress: Optional[tqdm] = None) -> dict:
    """{path, kind, size, sha256, records}: content hash and record count of one input (one read of the file)."""
    info: dict[str, Any] = {"path": source.path, "kind": source.kind}
    if source.kind in ("hf_disk", "hf_hub"):
        ds = _load_hf(source)
        files = [c["filename"] for c in ds.cache_files]
        h = hashlib.sha256()
        size = 0
        if files:
            for fn in files:
                h.update(sha256_file(Path(fn)).encode())
                size += os.path.getsize(fn)
            info["sha256"] = h.hexdigest()
        else:
            info["sha256"] = hashlib.sha256(str(ds._fingerprint).encode()).hexdigest()
        info["size"] = size
        info["records"] = len(ds)
        return info
    path = Path(source.path)
    h = hashlib.sha256()
    newlines = 0
    last = b""
    size = 0
    with open(path, "rb") as f:
        while True:
            b = f.read(1 << 23)
            if not b:
                break
            h.update(b)
            size += len(b)
            if source.kind == "jsonl":
                newlines += b.count(b"\n")
            last = b[-1:]
            if progress is not None:
                progress.update(len(b))
    info["size"] = size
    info["sha256"] = h.hexdigest()
    if source.kind == "jsonl":
        info["records"] = newlines + (1 if size and last != b"\n" else 0)
    elif source.kind == "txt":
        info["records"] = 1
    elif source.kind == "parquet":
        import pyarrow.parquet as pq
        info["records"] = pq.ParquetFile(path).metadata.num_rows
    elif source.kind == "json_array":
        info["records"] = len(_load_json_array(path))
    return info


def _load_json_array(path: Path) -> list:
    try:
        with open(path, "rb") as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise PretokenizeError(f"{path} line {exc.lineno} column {exc.colno}: invalid JSON ({exc.msg}); "
                               f"a JSON array file is parsed whole, use JSON lines to skip single bad records")
    except UnicodeDecodeError as exc:
        raise PretokenizeError(f"{path}: invalid UTF-8 at byte {exc.start} ({exc.reason})")
    if not isinstance(data, list):
        raise PretokenizeError(f"{path}: expected a JSON array or JSON lines")
    return data


# ----------------------------------------------------------------------------------------------------------------
# record stream: (doc_id, where, cursor_after) metadata + (kind, payload) for the encoder
#   kinds: "json" (a raw JSON line, bytes), "value" (the text field's value; None = missing), "obj" (a parsed JSON
#   value to take the field from), "bytes" (a whole .txt file)


@dataclass
class Cursor:
    """Position in the input stream: `record` = global index of the next record; `input`/`local` locate it;
    `offset` = byte offset of that line for JSON lines (None otherwise)."""

    record: int = 0
    input: int = 0
    local: int = 0
    offset: Optional[int] = 0

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Cursor":
        return cls(**d)


def _offset_of_line(path: Path, n: int) -> int:
    """Byte offset where (0-based) line `n` starts."""
    if n == 0:
        return 0
    seen = pos = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 23)
            if not chunk:
                raise PretokenizeError(f"{path}: has fewer than {n} lines (changed while running?)")
            c = chunk.count(b"\n")
            if seen + c >= n:
                idx = -1
                for _ in range(n - seen):
                    idx = chunk.index(b"\n", idx + 1)
                return pos + idx + 1
            seen += c
            pos += len(chunk)


def cursor_for_record(record: int, inputs: list[dict]) -> Cursor:
    """The cursor of global record index `record` (for a slice start), from the inputs' record counts."""
    start = 0
    for i, info in enumerate(inputs):
        n = info["records"]
        if record < start + n:
            local = record - start
            offset = _offset_of_line(Path(info["path"]), local) if info["kind"] == "jsonl" else None
            return Cursor(record, i, local, offset)
        start += n
    return Cursor(record, len(inputs), 0, None)


Record = tuple  # (doc_id, where, cursor_after: Cursor, kind, payload)


def iter_records(sources: list[InputSource], text_field: str, cursor: Cursor, end: Optional[int]) -> Iterator[Record]:
    """Records from `cursor` (inclusive) to global index `end` (exclusive; None = to the end), in input order."""
    rec = cursor.record
    for i in range(cursor.input, len(sources)):
        if end is not None and rec >= end:
            return
        src = sources[i]
        local = cursor.local if i == cursor.input else 0
        offset = cursor.offset if i == cursor.input else 0
        shown = src.display
        if src.kind == "jsonl":
            with open(src.path, "rb") as f:
                f.seek(offset or 0)
                pos = offset or 0
                for line in f:
                    if end is not None and rec >= end:
                        return
                    pos += len(line)
                    yield rec, f"{shown} line {local + 1}", Cursor(rec + 1, i, local + 1, pos), "json", line
                    rec += 1
                    local += 1
        elif src.kind == "txt":
            if local == 0:
                data = Path(src.path).read_bytes()
                yield rec, shown, Cursor(rec + 1, i, 1, None), "bytes", data
                rec += 1
        elif src.kind == "json_array":
            data = _load_json_array(Path(src.path))
            for j in range(local, len(data)):
                if end is not None and rec >= end:
                    return
                yield rec, f"{shown} element {j}", Cursor(rec + 1, i, j + 1, None), "obj", data[j]
                rec += 1
        elif src.kind == "parquet":
            yield from _iter_parquet(src, i, text_field, rec, local, end)
            n = _parquet_rows(src.path)
            rec += max(0, n - local) if end is None else max(0, min(n - local, end - rec))
        elif src.kind in ("hf_disk", "hf_hub"):
            ds = _load_hf(src)
            n = len(ds)
            stop = n if end is None else min(n, local + (end - rec))
            has_field = text_field in ds.column_names
            if has_field:
                ds = ds.select_columns([text_field])
            for a in range(local, stop, READ_BATCH_DOCS):
                b = min(stop, a + READ_BATCH_DOCS)
                values = ds[a:b][text_field] if has_field else [None] * (b - a)
                for j, v in enumerate(values):
                    r = rec + (a - local) + j
                    yield r, f"{shown} row {a + j}", Cursor(r + 1, i, a + j + 1, None), "value", v
            rec += max(0, stop - local)
        else:  # pragma: no cover
            raise PretokenizeError(f"{src.path}: unknown input kind {src.kind}")


def _parquet_rows(path: str) -> int:
    import pyarrow.parquet as pq
    return pq.ParquetFile(path).metadata.num_rows


def _iter_parquet(src: InputSource, i: int, text_field: str, rec: int, local: int,
                  end: Optional[int]) -> Iterator[Record]:
    import pyarrow.parquet as pq
    pf = pq.ParquetFile(src.path)
    n = pf.metadata.num_rows
    stop = n if end is None else min(n, local + (end - rec))
    if local >= stop:
        return
    has_field = text_field in pf.schema_arrow.names
    # first row group holding row `local`
    starts = [0]
    for g in range(pf.num_row_groups):
        starts.append(starts[-1] + pf.metadata.row_group(g).num_rows)
    g0 = bisect.bisect_right(starts, local) - 1
    row = starts[g0]
    if not has_field:
        batches: Iterable = ([None] * (stop - local),)
        row = local
    else:
        batches = (b.column(0).to_pylist() for b in
                   pf.iter_batches(batch_size=READ_BATCH_DOCS, row_groups=list(range(g0, pf.num_row_groups)),
                                   columns=[text_field]))
    for values in batches:
        for v in values:
            if row >= stop:
                return
            if row >= local:
                r = rec + (row - local)
                yield r, f"{src.display} row {row}", Cursor(r + 1, i, row + 1, None), "value", v
            row += 1


def _batched(records: Iterator[Record]) -> Iterator[tuple[list, list]]:
    """Group records into (metadata list, (kind, payload) list) batches for the encoder."""
    meta: list = []
    payloads: list = []
    nbytes = 0
    for doc_id, where, cur, kind, payload in records:
        meta.append((doc_id, where, cur))
        payloads.append((kind, payload))
        nbytes += len(payload) if isinstance(payload, (bytes, str)) else 64
        if len(meta) >= READ_BATCH_DOCS or nbytes >= READ_BATCH_BYTES:
            yield meta, payloads
            meta, payloads, nbytes = [], [], 0
    if meta:
        yield meta, payloads


# ----------------------------------------------------------------------------------------------------------------
# encoder pool (the per-batch work is balancer.tokenize.encode_payloads, importable without torch/datasets)

def _encode_stream(batches: Iterator[tuple[list, list]], cfg: EncoderConfig, tok: Tokenizer,
                   num_proc: int) -> Iterator[tuple[list, tuple]]:
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
    return datasets.Features({"input_ids": datasets.List(datasets.Value(np.dtype(dtype).name)),
                              "doc_id": datasets.Value("int64")})


def shard_file_names(name: str) -> tuple[str, str, str]:
    return f"{name}.arrow", f"{name}.lengths.npy", f"{name}.doc_ids.npy"


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
        return {"name": self.name, "rows": self.rows, "tokens": self.tokens, "documents": self.documents,
                "first_doc_id": int(docs[0]) if len(docs) else None,
                "last_doc_id": int(docs[-1]) if len(docs) else None,
                "max_length": int(lengths.max()) if len(lengths) else 0, "files": files}

    def abort(self) -> None:
        try:
            self.writer.close()
            self.sink.close()
        except Exception:  # noqa: BLE001
            pass


# ----------------------------------------------------------------------------------------------------------------
# counters

def _new_counters() -> dict:
    return {"records": 0, "documents": 0, "rows": 0, "tokens": 0, "skipped": {},
            "dropped_tokens": 0, "truncated_documents": 0, "truncated_tokens": 0, "split_documents": 0,
            "skipped_examples": []}


def _note_skip(counters: dict, reason: str, doc_id: int, where: str, message: str) -> None:
    counters["skipped"][reason] = counters["skipped"].get(reason, 0) + 1
    if len(counters["skipped_examples"]) < MAX_SKIPPED_EXAMPLES:
        counters["skipped_examples"].append({"doc_id": doc_id, "where": where, "reason": reason,
                                             "message": message})


# ----------------------------------------------------------------------------------------------------------------
# output folder

def _ours(name: str) -> bool:
    return (name in (MANIFEST_NAME, STATE_NAME, "state.json", "dataset_info.json") or name.endswith(".tmp")
            or bool(_SHARD_FILE_RE.match(name)))


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
            raise PretokenizeError(f"--output {out} holds a different job (other inputs, tokenizer or options); "
                                   f"pass --overwrite to replace it")
        raise PretokenizeError(f"--output {out} is not empty and holds no pretokenize job "
                               f"({len(entries)} entries, e.g. {sorted(entries)[0]!r}); pass --overwrite to use it")
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
    state = {"_data_files": [{"filename": f"{n}.arrow"} for n in shard_names], "_fingerprint": fingerprint[:16],
             "_format_columns": None, "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False,
             "_split": None}
    info = dataclasses.asdict(datasets.DatasetInfo(
        description="balancer pretokenize output: input_ids per row, doc_id = source record index",
        features=shard_features(dtype)))
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
    key = {"format": FORMAT_VERSION, "inputs": [[i["kind"], i["sha256"], i["records"]] for i in inputs],
           "tokenizer": tok.hash, "options": dataclasses.asdict(opts)}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def pretokenize(inputs: Sequence[str], output: str | os.PathLike, tokenizer: str = "byte",
                options: Optional[PretokenizeOptions] = None, num_proc: int = 1, num_shards: int = 1,
                shard_index: int = 0, overwrite: bool = False, progress: Optional[bool] = None) -> dict:
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
    with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="hashing inputs", disable=disable,
              file=sys.stderr) as bar:
        infos = [fingerprint_input(s, bar) for s in sources]
    job = _job_key(infos, tok, opts)
    total_records = sum(i["records"] for i in infos)
    start = shard_index * total_records // num_shards
    end = (shard_index + 1) * total_records // num_shards
    slice_ = None if num_shards == 1 else {"num_shards": num_shards, "shard_index": shard_index,
                                           "records": [start, end]}

    status, prev = _prepare_output(out, job, slice_, overwrite)
    if status == "complete":
        if (out / STATE_NAME).exists():  # killed between writing the manifest and removing the state file
            os.remove(out / STATE_NAME)
        problems = verify(out)
        if problems:
            raise PretokenizeError(f"{out} holds this job's finished output but it fails verification: "
                                   f"{problems[0]}; pass --overwrite to redo it")
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
    bar = tqdm(total=end - start, initial=cursor.record - start, unit="doc", desc="pretokenize", disable=disable,
               file=sys.stderr, smoothing=0.1)
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
                    ids = flat[offs[j]:offs[j + 1]]
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
                            writer.add(ids[a:a + (max_len or len(ids))], doc_id)
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
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "balancer_version": _version(), "job": job,
        "slice": slice_, "tokenizer": {**tok.describe(), "spec": tokenizer},
        "options": dataclasses.asdict(opts), "inputs": infos, "ignored_files": ignored,
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
    _log(f"{out}: {len(manifest['shards'])} shard(s), {c['documents']} documents, {c['rows']} rows, "
         f"{c['tokens']} tokens from {c['records']} records")
    if c["skipped"]:
        _log("skipped: " + ", ".join(f"{k}={v}" for k, v in sorted(c["skipped"].items()))
             + (f" (first: {manifest['skipped_records'][0]['where']}: {manifest['skipped_records'][0]['message']})"
                if manifest["skipped_records"] else ""))
    if c["truncated_documents"]:
        _log(f"truncated: {c['truncated_documents']} documents lost {c['truncated_tokens']} tokens")


def _version() -> str:
    from . import __version__
    return __version__


# ----------------------------------------------------------------------------------------------------------------
# verify

def load_manifest(path: str | os.PathLike) -> dict:
    """The manifest of a finished output folder; PretokenizeError when there is none (unfinished or not ours)."""
    p = Path(path) / MANIFEST_NAME
    if not p.is_file():
        raise PretokenizeError(f"{path}: no {MANIFEST_NAME} (not a finished `balancer pretokenize` output)")
    try:
        with open(p, encoding="utf-8") as f:
            m = json.load(f)
    except json.JSONDecodeError as exc:
        raise PretokenizeError(f"{p}: invalid JSON ({exc})") from exc
    if m.get("format") != FORMAT_NAME:
        raise PretokenizeError(f"{p}: not a {FORMAT_NAME} manifest")
    return m


def _open_arrow(path: Path) -> pa.Table:
    """Memory-mapped table of a shard (zero-copy)."""
    return pa.ipc.open_stream(pa.memory_map(str(path), "r")).read_all()


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
            lengths = np.concatenate([np.diff(c.offsets.to_numpy()) for c in col.chunks]) if col.num_chunks \
                else np.zeros(0, np.int64)
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
        problems.append(f"{out / MANIFEST_NAME}: counts say {c['rows']} rows / {c['tokens']} tokens, "
                        f"shards hold {rows} / {tokens}")
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
                raise PretokenizeError(f"merge: {p} differs from {mans[0][0]} in {key} (different inputs, "
                                       f"tokenizer or options)")
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
        skipped.extend(m["skipped_records"][:MAX_SKIPPED_EXAMPLES - len(skipped)])
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
    manifest.update({"slice": None, "merged_from": [str(by_index[i][0]) for i in range(k)], "counts": counts,
                     "skipped_records": skipped, "shards": shards})
    dtype = np.dtype(first["tokenizer"]["dtype"])
    _finish(out, manifest, dtype)
    _summary(out, manifest)
    return manifest


# ----------------------------------------------------------------------------------------------------------------
# reading

def read_lengths(path: str | os.PathLike) -> np.ndarray:
    """Per-row token lengths (int64, 1-D) from a pretokenized folder (its lengths index; no token data read), a
    `.npy` array, or a `.json` list of lengths (or an object with a "lengths" list). Raises ValueError naming the
    file when it holds something else."""
    p = Path(path)
    if p.is_dir():
        try:
            m = load_manifest(p)
        except PretokenizeError as exc:
            raise ValueError(str(exc)) from exc
        parts = [np.load(p / shard_file_names(e["name"])[1], allow_pickle=False) for e in m["shards"]]
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
    if not p.is_file():
        raise ValueError(f"{path}: no such file or directory")
    if p.suffix == ".npy":
        try:
            arr = np.load(p, allow_pickle=False)
        except Exception as exc:  # noqa: BLE001
            raise ValueError(f"{path}: not a readable .npy array ({exc})") from exc
    elif p.suffix == ".json":
        try:
            with open(p, encoding="utf-8") as f:
                data = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: invalid JSON ({exc})") from exc
        if isinstance(data, dict) and "lengths" in data:
            data = data["lengths"]
        if not isinstance(data, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in data):
            raise ValueError(f"{path}: expected a JSON list of integer lengths (or {{\"lengths\": [...]}})")
        arr = np.asarray(data, dtype=np.int64)
    else:
        raise ValueError(f"{path}: expected a pretokenized folder, a .npy or a .json file of lengths")
    if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"{path}: expected a 1-D integer array, got {arr.dtype} of shape {arr.shape}")
    if len(arr) and arr.min() < 0:
        raise ValueError(f"{path}: negative length at index {int(np.argmin(arr))}")
    return arr.astype(np.int64)


class ShardDataset(torch.utils.data.Dataset):
    """Map-style dataset over a finished pretokenize folder: `len(ds)` rows, `ds[i]` ->
    {"input_ids": LongTensor, "doc_id": int}. `.lengths` / `.doc_ids` (int64 numpy) come from the lengths index
    without touching the token data. Shards are memory-mapped lazily, per process (safe with DataLoader workers)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        m = load_manifest(self.path)
        self.manifest = m
        self._names = [e["name"] for e in m["shards"]]
        lens = [np.load(self.path / shard_file_names(n)[1], allow_pickle=False) for n in self._names]
        docs = [np.load(self.path / shard_file_names(n)[2], allow_pickle=False) for n in self._names]
        self.lengths: np.ndarray = np.concatenate(lens).astype(np.int64) if lens else np.zeros(0, np.int64)
        self.doc_ids: np.ndarray = np.concatenate(docs).astype(np.int64) if docs else np.zeros(0, np.int64)
        self._row_starts = np.concatenate([[0], np.cumsum([len(x) for x in lens])]).astype(np.int64)
        self._open: dict[int, tuple[np.ndarray, list]] = {}

    def __len__(self) -> int:
        return int(self._row_starts[-1])

    def __getstate__(self) -> dict:
        d = dict(self.__dict__)
        d["_open"] = {}
        return d

    def _shard(self, s: int) -> tuple[np.ndarray, list]:
        got = self._open.get(s)
        if got is None:
            table = _open_arrow(self.path / f"{self._names[s]}.arrow")
            chunks = table.column("input_ids").chunks
            starts = np.cumsum([0] + [len(c) for c in chunks]).astype(np.int64)
            got = (starts, [(c.offsets.to_numpy(), c.values.to_numpy()) for c in chunks])
            self._open[s] = got
        return got

    def token_ids(self, i: int) -> np.ndarray:
        """Row `i`'s ids as a read-only numpy view into the memory map (no copy)."""
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"row {i} out of range for {n} rows")
        s = int(np.searchsorted(self._row_starts, i, side="right") - 1)
        local = i - int(self._row_starts[s])
        starts, chunks = self._shard(s)
        c = int(np.searchsorted(starts, local, side="right") - 1)
        offs, vals = chunks[c]
        r = local - int(starts[c])
        return vals[offs[r]:offs[r + 1]]

    def __getitem__(self, i: int) -> dict:
        i = int(i)
        ids = self.token_ids(i)
        if i < 0:
            i += len(self)
        return {"input_ids": torch.from_numpy(ids.astype(np.int64)), "doc_id": int(self.doc_ids[i])}
