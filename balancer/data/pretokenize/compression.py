"""Compressed inputs of `balancer pretokenize`: gzip (`.gz`) and zstd (`.zst`) files read as a stream.

`open_input(path)` gives the decompressed bytes of any input file (a plain file as it is), so every reader sees
the same lines, line numbers and byte offsets as in the uncompressed file. Multi-member gzip files and multi-frame
zstd files are read whole. A corrupt or truncated stream raises `DataError` naming the file, the line and
the byte offset in the decompressed stream where reading stopped (every byte before it was delivered).
"""

from __future__ import annotations

import io
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, Optional

from balancer.data.shards.errors import DataError

COMPRESSION_SUFFIXES = {".gz": "gzip", ".zst": "zstd"}
RAW_CHUNK = 1 << 18  # compressed bytes fed to the decompressor at a time (bounds the error offset's granularity)
STREAM_BUFFER = 1 << 20


def compression_of(path: str | Path) -> Optional[str]:
    """'gzip' / 'zstd' for a `.gz` / `.zst` file name, else None."""
    return COMPRESSION_SUFFIXES.get(Path(path).suffix.lower())


def uncompressed_suffix(path: str | Path) -> str:
    """The suffix that says the format: `.jsonl` for `a.jsonl.gz` and for `a.jsonl`."""
    p = Path(path)
    if compression_of(p) is not None:
        p = p.with_suffix("")
    return p.suffix.lower()


def _zstd_module():
    try:
        import zstandard
    except ImportError:
        raise DataError("reading .zst inputs needs the zstandard package: pip install 'seqbalancer[zstd]'") from None
    return zstandard


def _new_decompressor(fmt: str) -> Any:
    if fmt == "gzip":
        return zlib.decompressobj(16 + zlib.MAX_WBITS)  # gzip header and CRC-32/size trailer checked
    return _zstd_module().ZstdDecompressor().decompressobj()


class DecompressedReader(io.RawIOBase):
    """The decompressed bytes of a `.gz` / `.zst` file (all members / frames), streamed. `on_raw(chunk)` is called
    with every compressed chunk read (hashing and progress over the compressed bytes). Tracks `produced`
    (decompressed bytes so far) and `lines` (newlines among them) to name where a corrupt stream breaks."""

    def __init__(self, path: str | Path, fmt: str, on_raw: Optional[Callable[[bytes], None]] = None) -> None:
        super().__init__()
        self.path = str(path)
        self.fmt = fmt
        self._errors: tuple = (zlib.error,) if fmt == "gzip" else (zlib.error, _zstd_module().ZstdError)
        self._file = open(path, "rb")
        self._on_raw = on_raw
        self._dec: Any = None  # decompressor of the member / frame in progress, None between members
        self._out = memoryview(b"")
        self._done = False
        self._error: Optional[str] = None  # raised once the good bytes before it have been read
        self.produced = 0
        self.lines = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        while not len(self._out):
            if self._error is not None:
                raise DataError(self._error)
            if self._done:
                return 0
            self._fill()
        n = min(len(buf), len(self._out))
        buf[:n] = self._out[:n]
        self._out = self._out[n:]
        return n

    def _fail(self, reason: str) -> None:
        self._error = (
            f"{self.path} line {self.lines + 1}: corrupt {self.fmt} stream at byte {self.produced} of the "
            f"decompressed data ({reason}); re-create or re-download the file"
        )

    def _fill(self) -> None:
        data = self._file.read(RAW_CHUNK)
        if data and self._on_raw is not None:
            self._on_raw(data)
        if not data:
            self._done = True
            if self._dec is not None:
                self._fail("the file ends inside a compressed block: truncated")
            return
        parts = []
        while data:
            if self._dec is None:
                self._dec = _new_decompressor(self.fmt)
            try:
                parts.append(self._dec.decompress(data))
            except self._errors as exc:
                self._fail(str(exc) or type(exc).__name__)
                break
            if self._dec.eof:
                data = self._dec.unused_data
                self._dec = None
            else:
                data = b""
        out = b"".join(parts)
        self.produced += len(out)
        self.lines += out.count(b"\n")
        self._out = memoryview(out)

    def drain_raw(self) -> None:
        """Pass the compressed bytes not read yet to `on_raw` (a checksum over the whole file)."""
        while self._on_raw is not None:
            data = self._file.read(RAW_CHUNK)
            if not data:
                return
            self._on_raw(data)

    def close(self) -> None:
        self._file.close()
        super().close()


def open_input(path: str | Path, on_raw: Optional[Callable[[bytes], None]] = None) -> BinaryIO:
    """A binary stream of the file's (decompressed) bytes. `on_raw` is only used for compressed files."""
    fmt = compression_of(path)
    if fmt is None:
        return open(path, "rb")
    return io.BufferedReader(DecompressedReader(path, fmt, on_raw), buffer_size=STREAM_BUFFER)


def seek_forward(stream: BinaryIO, offset: int) -> None:
    """Position `stream` at decompressed byte `offset` (a compressed stream is read up to it)."""
    if stream.seekable():
        stream.seek(offset)
        return
    left = offset
    while left > 0:
        chunk = stream.read(min(left, 1 << 22))
        if not chunk:
            raise DataError(f"{getattr(stream, 'name', stream)}: shorter than {offset} bytes (changed?)")
        left -= len(chunk)
