"""Inputs of `balancer pretokenize`: discovery (`resolve_inputs`), fingerprints (`fingerprint_input`) and the
record stream (`iter_records`, resumable at a `Cursor`) over .jsonl / .json / .parquet / .txt files (JSON and text
files also gzip or zstd compressed: `.jsonl.gz`, `.json.zst`, ...) and Hugging Face datasets; `DataError`, the
error of the whole pretokenize pipeline (bad input, refused output folder, ...).

A compressed input is streamed (`compression.py`): its records, line numbers and cursors are those of the
uncompressed file; its checksum (`sha256`, `size`) is over the compressed bytes as stored.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from tqdm import tqdm

from balancer.data.pretokenize.compression import (
    DecompressedReader,
    compression_of,
    open_input,
    seek_forward,
    uncompressed_suffix,
)
from balancer.data.shards.errors import DataError
from balancer.data.shards.manifest import sha256_file

READ_BATCH_DOCS = 1024  # documents per tokenization batch ...
READ_BATCH_BYTES = 4 << 20  # ... or this many bytes of raw text
INPUT_SUFFIXES = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".txt": "txt"}


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
    with open_input(path) as f:
        head = f.read(4096).lstrip()
    return "json_array" if head.startswith(b"[") else "jsonl"


def _source_for_file(p: Path) -> Optional[InputSource]:
    """The source of a file by its suffix (`.jsonl`, `.jsonl.gz`, ...); None for other files."""
    kind = INPUT_SUFFIXES.get(uncompressed_suffix(p))
    if kind is None or (kind == "parquet" and compression_of(p) is not None):
        return None
    if kind == "json":
        kind = _sniff_json(p)
    return InputSource(kind, str(p))


def resolve_inputs(specs: Sequence[str], exclude: Optional[Path] = None) -> tuple[list[InputSource], list[str]]:
    """Expand INPUT arguments into sources, in command-line order (directory contents sorted by relative path).

    Returns (sources, ignored files found in directories). Raises DataError for a missing path, an
    unsupported file type or a directory without inputs. A path that does not exist and does not look like a file
    path is taken as a Hugging Face hub dataset name. Files under `exclude` (the output folder) are skipped."""
    excl = exclude.resolve() if exclude is not None else None
    sources: list[InputSource] = []
    ignored: list[str] = []
    if not specs:
        raise DataError("no INPUT given")
    for spec in specs:
        p = Path(spec)
        if p.is_dir():
            if (
                (p / "state.json").is_file()
                and (p / "dataset_info.json").is_file()
                or (p / "dataset_dict.json").is_file()
            ):
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
                raise DataError(f"{spec}: directory holds no .jsonl/.json/.parquet/.txt(.gz/.zst) files")
            sources.extend(found)
        elif p.is_file():
            src = _source_for_file(p)
            if src is None:
                raise DataError(
                    f"{spec}: unsupported input type {''.join(p.suffixes[-2:])!r} (expected .jsonl, .json, .txt, "
                    f"each optionally .gz or .zst compressed, .parquet, a directory or a dataset name)"
                )
            sources.append(src)
        elif os.path.lexists(p):  # there, but neither a file nor a folder: never a hub dataset name
            raise DataError(f"{spec}: not a regular file or a folder (a pipe, device, socket or broken link)")
        elif uncompressed_suffix(p) in INPUT_SUFFIXES or spec.startswith((".", "/", "~")) or os.sep + os.sep in spec:
            raise DataError(f"{spec}: no such file or directory")
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
        raise DataError(f"{source.path}: cannot load with `datasets` ({type(exc).__name__}: {exc})") from exc
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(f"{source.path}: a DatasetDict without a 'train' split (splits: {list(ds)})")
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
    fmt = compression_of(path)
    if fmt is not None:
        sha, raw_size, size, newlines, last = _scan_compressed(path, fmt, progress)
        info.update(compression=fmt, size=raw_size, sha256=sha, decompressed_size=size)
    else:
        sha, size, newlines, last = _scan_plain(path, progress)
        info.update(size=size, sha256=sha)
    if source.kind == "jsonl":
        info["records"] = newlines + (1 if size and last != b"\n" else 0)
    elif source.kind == "txt":
        info["records"] = 1
    elif source.kind == "parquet":
        info["records"] = _parquet_rows(str(path))
    elif source.kind == "json_array":
        info["records"] = len(_load_json_array(path))
    return info


def _scan_plain(path: Path, progress: Optional[tqdm]) -> tuple[str, int, int, bytes]:
    """(sha256, size, newlines, last byte) of a plain file in one read."""
    h = hashlib.sha256()
    newlines = size = 0
    last = b""
    with open(path, "rb") as f:
        while True:
            b = f.read(1 << 23)
            if not b:
                break
            h.update(b)
            size += len(b)
            newlines += b.count(b"\n")
            last = b[-1:]
            if progress is not None:
                progress.update(len(b))
    return h.hexdigest(), size, newlines, last


def _scan_compressed(path: Path, fmt: str, progress: Optional[tqdm]) -> tuple[str, int, int, int, bytes]:
    """(sha256 and size of the compressed bytes, decompressed size, newlines, last byte) in one read; the whole
    stream is decompressed, so a corrupt or truncated one fails here, before any output is written."""
    h = hashlib.sha256()
    raw_size = 0

    def on_raw(chunk: bytes) -> None:
        nonlocal raw_size
        h.update(chunk)
        raw_size += len(chunk)
        if progress is not None:
            progress.update(len(chunk))

    reader = DecompressedReader(path, fmt, on_raw)
    last = b""
    with reader:
        buf = bytearray(1 << 22)
        while True:
            n = reader.readinto(buf)
            if not n:
                break
            last = bytes(buf[n - 1 : n])
        reader.drain_raw()
    return h.hexdigest(), raw_size, reader.produced, reader.lines, last


def _load_json_array(path: Path) -> list:
    try:
        with open_input(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise DataError(
            f"{path} line {exc.lineno} column {exc.colno}: invalid JSON ({exc.msg}); "
            f"a JSON array file is parsed whole, use JSON lines to skip single bad records"
        ) from None
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: invalid UTF-8 at byte {exc.start} ({exc.reason})") from None
    except RecursionError:
        raise DataError(f"{path}: invalid JSON (nested too deeply); a JSON array file is parsed whole") from None
    except ValueError as exc:  # an integer of more than 4300 digits
        raise DataError(f"{path}: invalid JSON ({exc}); a JSON array file is parsed whole") from None
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON array or JSON lines")
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
    def from_json(cls, d: dict) -> Cursor:
        return cls(**d)


def _offset_of_line(path: Path, n: int) -> int:
    """Byte offset where (0-based) line `n` starts."""
    if n == 0:
        return 0
    seen = pos = 0
    with open_input(path) as f:
        while True:
            chunk = f.read(1 << 23)
            if not chunk:
                raise DataError(f"{path}: has fewer than {n} lines (changed while running?)")
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


def input_bytes_read(cursor: Cursor, inputs: list[dict]) -> int:
    """Input bytes before `cursor` (uncompressed for compressed files; a progress measure): exact for JSON lines,
    pro rata by records for other kinds."""
    done = 0
    for i, info in enumerate(inputs[: cursor.input + 1]):
        size = info.get("decompressed_size", info.get("size", 0))
        if i < cursor.input:
            done += size
        elif cursor.offset is not None and info["kind"] == "jsonl":
            done += cursor.offset
        elif info["records"]:
            done += size * cursor.local // info["records"]
    return done


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
            with open_input(src.path) as f:
                seek_forward(f, offset or 0)
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
                with open_input(src.path) as f:
                    data = f.read()
                yield rec, shown, Cursor(rec + 1, i, 1, None), "bytes", data
                rec += 1
        elif src.kind == "json_array":
            elements = _load_json_array(Path(src.path))
            for j in range(local, len(elements)):
                if end is not None and rec >= end:
                    return
                yield rec, f"{shown} element {j}", Cursor(rec + 1, i, j + 1, None), "obj", elements[j]
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
            raise DataError(f"{src.path}: unknown input kind {src.kind}")


def _parquet_rows(path: str) -> int:
    """Rows of a parquet file (from its footer); DataError naming the file when it is not one."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path).metadata.num_rows
    except (pa.ArrowInvalid, pa.ArrowIOError) as exc:
        raise DataError(f"{path}: not a readable parquet file ({exc})") from None


def _iter_parquet(
    src: InputSource, i: int, text_field: str, rec: int, local: int, end: Optional[int]
) -> Iterator[Record]:
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
        batches = (
            b.column(0).to_pylist()
            for b in pf.iter_batches(
                batch_size=READ_BATCH_DOCS, row_groups=list(range(g0, pf.num_row_groups)), columns=[text_field]
            )
        )
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
