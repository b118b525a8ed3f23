"""The Ray Data engine of `balancer pretokenize` (`--engine ray [--ray-address ADDR]`).

Reading and tokenizing run as Ray Data tasks; the driver writes the shards exactly as the local engine does, so
rows, shard boundaries, manifest (except its `engine` entry), resume and `verify` are the same. The input records
from the run's cursor to its end are cut into ranges (`plan_ranges`): plain JSON lines, parquet files and datasets
every `RANGE_RECORDS` records, a compressed file, a JSON array file or a .txt file whole. Each task reads its range
from the inputs (so on a multi-node cluster inputs must be on a filesystem every node sees, at the same path),
tokenizes it and returns the encoded batches; the driver consumes them in input order (Ray Data keeps the order)
and commits a shard only when it is complete. A task whose worker dies is retried `TASK_RETRIES` times; then the run
stops with an error naming the range, having committed whole shards only (rerun to resume).
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from balancer.data.pretokenize.compression import compression_of, open_input, seek_forward
from balancer.data.pretokenize.readers import Cursor, InputSource, _batched, iter_records
from balancer.data.pretokenize.tokenize import _WORKER, EncoderConfig, encode_payloads, init_encoder
from balancer.data.shards.errors import DataError, arg

logger = logging.getLogger(__name__)

RANGE_RECORDS = 16384  # records per task for splittable inputs
TASK_RETRIES = 3  # a task whose worker dies is run again this many times
CONNECT_TIMEOUT_S = 10.0

EncodedBatch = tuple[list, tuple]  # (meta [(doc_id, where, cursor_after)], (lengths, flat ids, errors))


# ----------------------------------------------------------------------------------------------------------------
# cluster


def _ray():
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise DataError(f"{arg('engine', 'ray')} needs Ray Data: pip install 'seqbalancer[ray]'") from None
    return ray


def _check_reachable(address: str) -> None:
    """Fail fast (Ray itself retries for minutes) when `address` names a host:port nobody listens on."""
    if address == "auto":
        return
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise DataError(f"{arg('ray_address')} {address!r}: expected HOST:PORT, ray://HOST:PORT or auto")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise DataError(
            f"{arg('ray_address')} {address}: cannot reach {host}:{port} ({exc}); start the cluster there "
            f"(`ray start --head`) or fix the address"
        ) from None


def connect(address: Optional[str], num_cpus: Optional[int] = None) -> Callable[[], None]:
    """Attach to the Ray cluster at `address`, or start a local one (`num_cpus` CPUs; None = all) when `address` is
    None. A process already attached to a cluster keeps it. Returns the function that undoes what was done."""
    ray = _ray()
    if address:
        _check_reachable(address)
    if ray.is_initialized():
        return lambda: None
    kwargs = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
    if address:
        try:
            ray.init(address=address, **kwargs)
        except Exception as exc:  # noqa: BLE001 - Ray raises ConnectionError, RuntimeError, ...
            raise DataError(f"{arg('ray_address')} {address}: cannot connect ({type(exc).__name__}: {exc})") from exc
    else:
        logger.info("starting a local Ray cluster (%s CPUs)", num_cpus or "all")
        ray.init(num_cpus=num_cpus, **kwargs)
    return ray.shutdown


def describe(address: Optional[str]) -> dict:
    """The manifest's `engine` entry for a Ray run."""
    return {"name": "ray", "ray_version": _ray().__version__, "address": address or "local"}


# ----------------------------------------------------------------------------------------------------------------
# ranges


def _line_offsets(path: str, first_line: int, first_offset: int, lines: list[int]) -> list[int]:
    """Byte offsets (in the uncompressed stream) where the 0-based `lines` (sorted, >= first_line) start, reading
    once from `first_offset`, where `first_line` starts."""
    found: list[int] = []
    want = iter(lines)
    target = next(want, None)
    line, pos = first_line, first_offset
    with open_input(path) as f:
        seek_forward(f, first_offset)
        while target is not None:
            while target is not None and target == line:
                found.append(pos)
                target = next(want, None)
            chunk = f.read(1 << 23)
            if not chunk:
                break
            starts = np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 10) + 1  # line starts after each \n
            while target is not None and target - line <= len(starts):
                found.append(pos + int(starts[target - line - 1]))
                target = next(want, None)
            line += len(starts)
            pos += len(chunk)
    if target is not None:
        raise DataError(f"{path}: has fewer than {target} lines (changed while running?)")
    return found


def plan_ranges(
    sources: list[InputSource], infos: list[dict], cursor: Cursor, end: int, range_records: int = RANGE_RECORDS
) -> list[tuple[Cursor, int]]:
    """(start cursor, end record) of every task from `cursor` to global record `end`, in input order."""
    ranges: list[tuple[Cursor, int]] = []
    first = 0  # global index of input i's first record
    for i, (src, info) in enumerate(zip(sources, infos)):
        n = info["records"]
        lo = cursor.local if i == cursor.input else 0
        hi = min(n, end - first)
        if i >= cursor.input and lo < hi:
            whole = src.kind in ("json_array", "txt") or compression_of(src.path) is not None
            step = hi - lo if whole else range_records
            starts = list(range(lo, hi, step))
            if src.kind == "jsonl":
                origin = (lo, cursor.offset or 0) if i == cursor.input else (0, 0)
                offsets: list = _line_offsets(src.path, origin[0], origin[1], starts)
            else:
                offsets = [None] * len(starts)
            for local, offset in zip(starts, offsets):
                ranges.append((Cursor(first + local, i, local, offset), first + min(hi, local + step)))
        first += n
        if first >= end:
            break
    return ranges


# ----------------------------------------------------------------------------------------------------------------
# tasks


@dataclass(frozen=True)
class _TaskSource(InputSource):
    """An input as a task reads it: an absolute path (workers need not share the driver's working directory),
    shown in messages as the user wrote it (so `where` strings equal the local engine's)."""

    shown: str = ""

    @property
    def display(self) -> str:
        return self.shown


def _task_sources(sources: list[InputSource]) -> list[InputSource]:
    local = ("hf_hub",)
    return [s if s.kind in local else _TaskSource(s.kind, str(Path(s.path).resolve()), s.display) for s in sources]


def _encode_task(batch: dict, sources: list[InputSource], cfg: EncoderConfig) -> dict:
    """Ray Data map_batches function: one range in, its encoded batches out (one row per batch)."""
    if _WORKER.get("cfg") != cfg or "tok" not in _WORKER:  # a worker process keeps its tokenizer between tasks
        init_encoder(cfg)
    rows: dict[str, list] = {"meta": [], "lengths": [], "flat": [], "dtype": [], "errors": []}
    for spec in batch["range"].to_pylist():
        start_json, end = json.loads(spec)
        records = iter_records(sources, cfg.text_field, Cursor.from_json(start_json), end)
        for meta, payloads in _batched(records):
            lengths, flat, errors = encode_payloads(payloads)
            rows["meta"].append(json.dumps([[d, w, c.to_json()] for d, w, c in meta]))
            rows["lengths"].append(np.ascontiguousarray(lengths, dtype=np.int64).tobytes())
            rows["flat"].append(flat.tobytes())
            rows["dtype"].append(flat.dtype.name)
            rows["errors"].append(json.dumps({str(k): list(v) for k, v in errors.items()}))
    import pyarrow as pa

    types = {"meta": pa.large_string(), "lengths": pa.large_binary(), "flat": pa.large_binary()}
    return pa.table({k: pa.array(v, type=types.get(k, pa.string())) for k, v in rows.items()})


def _decode_row(row: dict) -> EncodedBatch:
    meta = [(d, w, Cursor.from_json(c)) for d, w, c in json.loads(row["meta"])]
    lengths = np.frombuffer(row["lengths"], dtype=np.int64)
    flat = np.frombuffer(row["flat"], dtype=np.dtype(row["dtype"]))
    errors = {int(k): tuple(v) for k, v in json.loads(row["errors"]).items()}
    return meta, (lengths, flat, errors)


def encode_stream(
    sources: list[InputSource], infos: list[dict], cfg: EncoderConfig, cursor: Cursor, end: int, num_proc: int
) -> Iterator[EncodedBatch]:
    """The encoded batches from `cursor` to record `end`, in input order, tokenized by Ray Data tasks (at most
    `num_proc` at a time) on the cluster `connect` attached to."""
    ray = _ray()
    ranges = plan_ranges(sources, infos, cursor, end, RANGE_RECORDS)
    if not ranges:
        return
    items = [{"range": json.dumps([c.to_json(), e])} for c, e in ranges]
    with _quiet_ordered_ray_data(ray):
        yield from _run_tasks(ray, items, ranges, sources, cfg, min(num_proc, len(items)))


@contextlib.contextmanager
def _quiet_ordered_ray_data(ray) -> Iterator[None]:
    """Ray Data settings for one run, restored after: output in input order, no Ray progress bars or INFO lines
    (the pipeline draws its own bar)."""
    ctx = ray.data.DataContext.get_current()
    data_logger = logging.getLogger("ray.data")
    saved = (ctx.execution_options.preserve_order, ctx.enable_progress_bars, data_logger.level)
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False
    data_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        ctx.execution_options.preserve_order, ctx.enable_progress_bars = saved[:2]
        data_logger.setLevel(saved[2])


def _run_tasks(
    ray, items: list, ranges: list, sources: list, cfg: EncoderConfig, concurrency: int
) -> Iterator[EncodedBatch]:
    """The tasks' encoded batches in input order; a failure becomes one DataError."""
    with warnings.catch_warnings():
        # Ray Data retries the task of a dead worker forever unless the task's remote args bound it; up to Ray 2.63
        # only the (deprecated) remote-args route sets it
        warnings.simplefilter("ignore", DeprecationWarning)
        ds = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
            _encode_task,
            batch_size=1,
            batch_format="pyarrow",
            fn_kwargs={"sources": _task_sources(sources), "cfg": cfg},
            num_cpus=1,
            concurrency=concurrency,
            max_retries=TASK_RETRIES,
            retry_exceptions=False,
        )
    done = 0  # batches handed on; the range in flight is named in errors
    try:
        for row in ds.iter_rows():
            decoded = _decode_row(row)
            done = decoded[0][-1][2].record
            yield decoded
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001 - Ray wraps task failures in several exception types
        pending = next(((c, e) for c, e in ranges if e > done), ranges[-1])[0]
        cause = _root_cause(exc)
        if isinstance(cause, DataError):
            raise cause from None
        detail = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        retried = f" after {TASK_RETRIES} retries" if type(cause).__module__.startswith("ray") else ""  # a dead worker
        raise DataError(
            f"Ray engine: a task failed{retried} ({type(cause).__name__}: {detail}) with records "
            f"from {pending.record} on ({sources[pending.input].display} from record {pending.local}) unfinished; "
            f"only whole shards were kept: rerun the same command to resume"
        ) from exc


def _root_cause(exc: BaseException) -> BaseException:
    """The innermost exception of a Ray error chain (a task's own exception, or the worker crash)."""
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        nxt = getattr(exc, "cause", None) or exc.__cause__
        if not isinstance(nxt, BaseException):
            break
        exc = nxt
    return exc
