"""The one reader of document lengths, for the CLI, the sampler and `ShardDataset`.

`read_lengths(source)` takes a pretokenized folder (its lengths index, checked on open), a `.npy` array, a `.npz`
archive holding `lengths`, a `.json` list (or an object with a "lengths" list), a text file of one length per line,
or a built-in trace name. It returns int64 lengths >= 0 and raises ValueError naming the file and the entry for
anything else (not integers, negative, beyond int64, not 1-D). Whether zero-length documents may be planned is the
planner's rule (`validate_lengths`), not the reader's.

`map_lengths(source)` reads the same sources without a whole copy where the source allows: a folder's lengths as a
`ShardedArray` over its memory-mapped shard index files, a `.npy` array memory-mapped as it is stored (its values are
checked by whoever scans them: the sampler's `scan_lengths`); anything else as `read_lengths` does.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np

INT64_MAX = int(np.iinfo(np.int64).max)


def _from_python_ints(values: list, name: str) -> np.ndarray:
    for i, v in enumerate(values):
        if not isinstance(v, int) or isinstance(v, bool):
            raise ValueError(f"{name}[{i}] = {v!r} is not an integer length")
        if not 0 <= v <= INT64_MAX:
            raise ValueError(f"{name}[{i}] = {v} is out of range (lengths are 0 .. 2**63-1)")
    return np.asarray(values, dtype=np.int64)


def check_lengths_array(arr: np.ndarray, name: str) -> np.ndarray:
    """`arr` as int64 lengths, or a ValueError naming `name` and the first bad entry."""
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D array of lengths, got shape {arr.shape}")
    kind = arr.dtype.kind
    if kind == "f":
        bad = ~np.isfinite(arr) | (arr != np.round(arr)) | (np.abs(arr) > INT64_MAX)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"{name}[{i}] = {arr[i].item()!r} is not an integer length")
    elif kind == "u":
        bad = arr > INT64_MAX
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"{name}[{i}] = {arr[i].item()} is out of range (lengths are 0 .. 2**63-1)")
    elif kind != "i":
        raise ValueError(f"{name}: expected integer lengths, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    if len(arr) and arr.min() < 0:
        i = int(np.argmin(arr))
        raise ValueError(f"{name}[{i}] = {arr[i]} is negative")
    return arr


def _read_npy(path: Path) -> np.ndarray:
    try:
        return np.load(path, allow_pickle=False)
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"{path}: not a readable .npy array ({type(exc).__name__}: {exc})") from None


def _read_npz(path: Path) -> np.ndarray:
    try:
        with np.load(path, allow_pickle=False) as archive:
            if "lengths" not in archive.files:
                raise ValueError(f"{path}: no 'lengths' array in the .npz (it holds: {', '.join(archive.files)})")
            return archive["lengths"]
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"{path}: not a readable .npz archive ({type(exc).__name__}: {exc})") from None


def _read_json(path: Path, text: str) -> np.ndarray:
    from balancer.strict_json import parse_json

    data = parse_json(text, str(path))  # strict: duplicate keys, NaN, nesting and giant integers refused
    if isinstance(data, dict) and "lengths" in data:  # other keys are left alone (a plan file carries its lengths)
        data = data["lengths"]
    if not isinstance(data, list):
        raise ValueError(f'{path}: expected a JSON list of integer lengths (or {{"lengths": [...]}})')
    return _from_python_ints(data, str(path))


_LENGTH_LINE = re.compile(r"[ \t]*(-?[0-9]+)[ \t]*")  # a sign: a negative length is named out of range


def _read_text(path: Path, text: str) -> np.ndarray:
    """One length per line in ASCII digits (document i is line i + 1, so a blank line is refused, except at the
    end); `int`'s leniency (`1_000`, `+5`, other scripts' digits) is not accepted."""
    lines = text.removeprefix("\ufeff").splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    values = []
    for lineno, line in enumerate(lines, 1):
        match = _LENGTH_LINE.fullmatch(line)
        if match is None:
            what = (
                "an empty line (one length per line: document ids are line numbers)"
                if not line.strip()
                else (f"not an integer length: {line.strip()!r}")
            )
            raise ValueError(f"{path}:{lineno}: {what}")
        values.append(int(match.group(1)))
    return _from_python_ints(values, str(path))


def map_lengths(source: str | os.PathLike) -> Any:
    """Lengths from the sources of `read_lengths`, without a whole copy for a pretokenized folder (a `ShardedArray`,
    checked on open) or a `.npy` file (memory-mapped, values unchecked); other sources as `read_lengths`."""
    path = Path(source)
    if path.is_dir():
        return _open_folder(path).lengths_view()
    if path.suffix == ".npy" and path.is_file():
        try:
            return np.load(path, mmap_mode="r", allow_pickle=False)
        except Exception as exc:  # noqa: BLE001 - any unreadable file is one error naming it
            raise ValueError(f"{path}: not a readable .npy array ({type(exc).__name__}: {exc})") from None
    return read_lengths(source)


def _open_folder(path: Path):
    from balancer.data.shards.checks import open_folder
    from balancer.data.shards.errors import DataError

    try:
        return open_folder(path)
    except DataError as exc:
        raise ValueError(str(exc)) from None


def read_lengths(source: str | os.PathLike) -> np.ndarray:
    """Per-document token lengths (int64, 1-D, >= 0) from a pretokenized folder, a .npy / .npz / .json / text
    file, or a built-in trace name; ValueError naming the file (and entry or line) for anything else."""
    path = Path(source)
    if path.is_dir():
        return _open_folder(path).lengths()
    if not path.exists():
        from balancer.data.traces import NAMES, load_trace

        if str(source) in NAMES:
            return load_trace(str(source))
        raise ValueError(f"{source}: no such file, folder or built-in trace ({', '.join(NAMES)})")
    if path.suffix == ".npy":
        return check_lengths_array(_read_npy(path), str(path))
    if path.suffix == ".npz":
        return check_lengths_array(_read_npz(path), str(path))
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not a text file of lengths (invalid UTF-8 at byte {exc.start})") from None
    if path.suffix == ".json" or text.lstrip().startswith(("[", "{")):
        return _read_json(path, text)
    return _read_text(path, text)
