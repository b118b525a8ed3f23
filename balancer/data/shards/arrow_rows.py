"""Shard Arrow files: `stream_row_count` (the row count from the message headers alone, a few bytes per record
batch, no pyarrow) and `open_arrow` (the memory-mapped table, zero-copy).

Reading a stream with pyarrow touches every record batch's pages (memory map faults read ahead, file reads read
the bodies); the open-time checks want the row count without reading token data, so this walks the encapsulated
messages (continuation marker, metadata length, flatbuffer `Message`, body) and skips each body by its
`bodyLength`. Only the fields needed are decoded: Message.header_type, Message.header, Message.bodyLength and
RecordBatch.length (Arrow columnar format, "Encapsulated message format").
"""

from __future__ import annotations

import os
import struct
from typing import Any

_CONTINUATION = 0xFFFFFFFF
_RECORD_BATCH = 3  # MessageHeader union tag
_SCHEMA = 1
_FIRST_READ = 1024  # bytes read per message: our headers are a few hundred


class ArrowHeaderError(ValueError):
    """The file is not a well-formed Arrow IPC stream (truncated, bad marker, or a body past the end)."""


def _field_pos(buf: bytes, table: int, field: int) -> int:
    """Absolute position of flatbuffer table field `field`, or 0 when absent (default value)."""
    vtable = table - struct.unpack_from("<i", buf, table)[0]
    vt_size = struct.unpack_from("<H", buf, vtable)[0]
    slot = 4 + 2 * field
    if slot >= vt_size:
        return 0
    off = struct.unpack_from("<H", buf, vtable + slot)[0]
    return table + off if off else 0


def _message_fields(meta: bytes) -> tuple[int, int, int]:
    """(header_type, RecordBatch.length or 0, bodyLength) of one flatbuffer Message."""
    table = struct.unpack_from("<I", meta, 0)[0]
    pos = _field_pos(meta, table, 1)
    header_type = meta[pos] if pos else 0
    pos = _field_pos(meta, table, 3)
    body_length = struct.unpack_from("<q", meta, pos)[0] if pos else 0
    rows = 0
    if header_type == _RECORD_BATCH:
        pos = _field_pos(meta, table, 2)
        header = pos + struct.unpack_from("<I", meta, pos)[0]
        pos = _field_pos(meta, header, 0)
        rows = struct.unpack_from("<q", meta, pos)[0] if pos else 0
    return header_type, rows, body_length


def stream_row_count(path: str | os.PathLike) -> int:
    """Total rows of the record batches in an Arrow IPC stream file; ArrowHeaderError when malformed."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):  # header reads only: no read-ahead into the bodies
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        size = os.fstat(fd).st_size
        pos = rows = 0
        seen_schema = False
        while True:
            head = os.pread(fd, _FIRST_READ, pos)  # marker, length and (nearly always) the whole header at once
            if len(head) < 8:
                raise ArrowHeaderError(f"{path}: truncated at byte {pos} (no end-of-stream marker)")
            marker, meta_len = struct.unpack_from("<Ii", head)
            if marker != _CONTINUATION:
                raise ArrowHeaderError(f"{path}: byte {pos}: not an Arrow IPC message")
            if meta_len == 0:
                if not seen_schema:
                    raise ArrowHeaderError(f"{path}: stream without a schema")
                return rows
            meta = head[8 : 8 + meta_len] if 8 + meta_len <= len(head) else os.pread(fd, meta_len, pos + 8)
            if meta_len < 0 or len(meta) < meta_len:
                raise ArrowHeaderError(f"{path}: truncated message header at byte {pos}")
            try:
                header_type, batch_rows, body_length = _message_fields(meta)
            except (struct.error, IndexError):
                raise ArrowHeaderError(f"{path}: malformed message header at byte {pos}") from None
            seen_schema = seen_schema or header_type == _SCHEMA
            pos += 8 + meta_len + body_length
            if body_length < 0 or batch_rows < 0 or pos > size:
                raise ArrowHeaderError(f"{path}: message at byte {pos} runs past the end of the file")
            rows += batch_rows
    finally:
        os.close(fd)


def open_arrow(path: str | os.PathLike) -> Any:
    """Memory-mapped `pyarrow.Table` of a shard's Arrow IPC stream (zero-copy)."""
    import pyarrow as pa

    from balancer.data.shards.mapped import map_readonly

    return pa.ipc.open_stream(pa.py_buffer(map_readonly(path))).read_all()  # no descriptor kept per shard
