"""Read-only memory maps that hold no file descriptor.

Python's `mmap.mmap` (and so `np.memmap`) and `pyarrow.memory_map` keep the file open for as long as the map
lives, so a folder of 600 shards mapped at once (two index files and one Arrow file each) needs ~1,800 descriptors
and fails under the common `ulimit -n 1024` ("Too many open files"). The kernel does not need the descriptor once
the map exists: `map_readonly` maps with libc's `mmap(2)`, closes the descriptor at once, and unmaps when the last
view of the bytes is gone. Where libc cannot be reached it falls back to `mmap.mmap` (one descriptor per map).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref
from typing import Optional

_libc: Optional[ctypes.CDLL]
try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _libc.mmap.restype = ctypes.c_void_p
    _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    _libc.munmap.restype = ctypes.c_int
    _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
except (OSError, AttributeError):  # no libc with mmap (not a POSIX system)
    _libc = None
_MAP_FAILED = ctypes.c_void_p(-1).value


def map_readonly(path: str | os.PathLike) -> memoryview:
    """The file's bytes as a read-only memoryview over a shared memory map (empty for an empty file); no file
    descriptor stays open. Raises OSError (with `strerror`) when the file cannot be opened or mapped."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return memoryview(b"")
        if _libc is None:
            return memoryview(mmap.mmap(fd, 0, access=mmap.ACCESS_READ))
        ptr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if ptr is None or ptr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), str(path))
    finally:
        os.close(fd)
    block = (ctypes.c_char * size).from_address(ptr)
    weakref.finalize(block, _libc.munmap, ptr, size)  # when every view of `block` is gone
    return memoryview(block).cast("B").toreadonly()
