"""Strict reading of the JSON files balancer trusts: plans, cost models, model configs, manifests, states.

`load_json(path)` reads one file (non-UTF-8 bytes, invalid JSON, NaN/Infinity, duplicate keys, nesting deeper
than the recursion limit, integers of more than 4300 digits: one `JSONFileError` naming the file). `check(value, field,
file)` checks a parsed value against a small schema built from `integer`, `number`, `boolean`, `string`, `array`,
`obj` and `anything`: exact types (a bool is not an integer, a string is not a bool), integer ranges (int64 unless
narrower), required and optional keys, unknown keys refused with the closest known key suggested.
`check_format(data, file, spec)` checks `format` / `format_version` and returns the file's version.

Every error is one line: `PATH: "key.path": expected ..., got ...`.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

from balancer.limits import INT64_MAX, INT64_MIN, MAX_COEFFICIENT

# bounds that only keep numbers representable: named in an error only when the value broke them
_SAFETY_BOUNDS = (INT64_MIN, INT64_MAX, MAX_COEFFICIENT)

__all__ = [
    "INT64_MAX",
    "INT64_MIN",
    "Field",
    "FormatSpec",
    "JSONFileError",
    "anything",
    "array",
    "boolean",
    "check",
    "check_format",
    "integer",
    "load_json",
    "number",
    "obj",
    "parse_json",
    "string",
]


class JSONFileError(ValueError):
    """A JSON file (or a value in one) that is not what it must be; the message names the file and key path."""


@dataclass(frozen=True)
class Field:
    """What one value must be. `kind`: int, number, bool, str, list, object or any. `keys` (objects): the allowed
    keys; `items` (lists): every element's field; `since`: the format_version that introduced this key."""

    kind: str
    required: bool = True
    nullable: bool = False
    min: Optional[float] = None
    max: Optional[float] = None
    choices: Optional[tuple] = None
    items: Optional[Field] = None
    keys: Optional[Mapping[str, Field]] = None
    max_items: Optional[int] = None
    since: int = 1


def integer(min: Optional[int] = None, max: Optional[int] = None, **kw: Any) -> Field:
    """An integer (not a bool, not 3.0) in [min, max], both defaulting to the int64 bounds."""
    return Field("int", min=INT64_MIN if min is None else min, max=INT64_MAX if max is None else max, **kw)


def number(min: Optional[float] = None, max: Optional[float] = None, **kw: Any) -> Field:
    """A finite int or float (not a bool) in [min, max]."""
    return Field("number", min=min, max=max, **kw)


def boolean(**kw: Any) -> Field:
    """`true` or `false` (not "false", not 0)."""
    return Field("bool", **kw)


def string(choices: Optional[tuple] = None, **kw: Any) -> Field:
    return Field("str", choices=choices, **kw)


def array(items: Optional[Field] = None, max_items: Optional[int] = None, **kw: Any) -> Field:
    return Field("list", items=items, max_items=max_items, **kw)


def obj(keys: Optional[Mapping[str, Field]] = None, **kw: Any) -> Field:
    """An object; with `keys`, exactly those keys (required ones present, no others)."""
    return Field("object", keys=keys, **kw)


def anything(**kw: Any) -> Field:
    """Any JSON value (free-form reports)."""
    return Field("any", **kw)


# ---------------------------------------------------------------------------------------------------- loading
def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _unique_keys(pairs: list) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {json.dumps(key)} appears twice in one object")
        out[key] = value
    return out


def parse_json(data: bytes | str, name: str, allow_nan: bool = False) -> Any:
    """Parse JSON text read from `name` (a file name, or `name[field]`), strictly; JSONFileError naming it.
    `allow_nan`: read NaN / Infinity as floats (older files of ours wrote them; the schema still refuses them
    wherever a finite number is due)."""
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise JSONFileError(f"{name}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})") from None
    if data.startswith("\ufeff"):
        data = data[1:]  # a UTF-8 byte-order mark, as some editors write
    try:
        constant = float if allow_nan else _refuse_constant
        return json.loads(data, object_pairs_hook=_unique_keys, parse_constant=constant)
    except json.JSONDecodeError as e:
        raise JSONFileError(f"{name}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except RecursionError:
        raise JSONFileError(f"{name}: JSON nested too deeply (over {sys.getrecursionlimit()} levels)") from None
    except ValueError as e:  # duplicate keys, NaN, an integer of more than 4300 digits
        reason = "an integer of more than 4300 digits" if "digits" in str(e) else str(e)
        raise JSONFileError(f"{name}: invalid JSON: {reason}") from None


def load_json(path: str | os.PathLike, allow_nan: bool = False) -> Any:
    """Read and parse one JSON file strictly (see the module docstring); OSError as raised by `open`."""
    with open(path, "rb") as f:
        data = f.read()
    return parse_json(data, os.fspath(path), allow_nan)


# ---------------------------------------------------------------------------------------------------- checking
_KIND_WORDS = {
    "int": "an integer",
    "number": "a number",
    "bool": "true or false",
    "str": "a string",
    "list": "a list",
    "object": "an object",
}


def _show(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


_BOUND_NAMES: dict[float, str] = {INT64_MIN: "-2^63", INT64_MAX: "2^63-1"}


def _bound(x: float) -> str:
    return _BOUND_NAMES.get(x, str(x))


def _expected(field: Field, value: Any = None) -> str:
    if field.choices is not None:
        return "one of " + ", ".join(_show(c) for c in field.choices) + (" or null" if field.nullable else "")
    words = _KIND_WORDS.get(field.kind, "a value")
    if field.kind in ("int", "number"):
        lo = field.min if field.min is not None and field.min not in _SAFETY_BOUNDS else None
        hi = field.max if field.max is not None and field.max not in _SAFETY_BOUNDS else None
        if isinstance(value, (int, float)) and not isinstance(value, bool):  # name the int64 bound it broke
            lo = field.min if field.min is not None and value < field.min else lo
            hi = field.max if field.max is not None and value > field.max else hi
        if lo is not None and hi is not None:
            words += f" in [{_bound(lo)}, {_bound(hi)}]"
        elif lo is not None:
            words += f" >= {_bound(lo)}"
        elif hi is not None:
            words += f" <= {_bound(hi)}"
    return words + (" or null" if field.nullable else "")


def _where(file: str, path: str) -> str:
    return f"{file}: {json.dumps(path)}" if path else f"{file}"


def _fail(file: str, path: str, field: Field, value: Any) -> JSONFileError:
    return JSONFileError(f"{_where(file, path)}: expected {_expected(field, value)}, got {_show(value)}")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def check(value: Any, field: Field, file: str, path: str = "", version: Optional[int] = None) -> Any:
    """`value` if it fits `field`, else JSONFileError naming `file` and the key `path`. `version`: the file's
    format_version; keys introduced later (`since`) are refused in older files. Returns the value unchanged."""
    if value is None:
        if field.nullable or field.kind == "any":
            return value
        raise _fail(file, path, field, value)
    kind = field.kind
    if kind == "any":
        return value
    if kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind == "number":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    elif kind == "bool":
        ok = isinstance(value, bool)
    elif kind == "str":
        ok = isinstance(value, str)
    elif kind == "list":
        ok = isinstance(value, list)
    else:
        ok = isinstance(value, dict)
    if not ok or (field.choices is not None and value not in field.choices):
        raise _fail(file, path, field, value)
    if kind in ("int", "number"):
        if (field.min is not None and value < field.min) or (field.max is not None and value > field.max):
            raise _fail(file, path, field, value)
    elif kind == "list":
        if field.max_items is not None and len(value) > field.max_items:
            raise JSONFileError(f"{_where(file, path)}: more than {field.max_items} entries ({len(value)})")
        if field.items is not None:
            for i, item in enumerate(value):
                check(item, field.items, file, f"{path}[{i}]", version)
    elif kind == "object" and field.keys is not None:
        _check_keys(value, field.keys, file, path, version)
    return value


def _check_keys(data: dict, keys: Mapping[str, Field], file: str, path: str, version: Optional[int]) -> None:
    for key in data:
        if key not in keys:
            close = difflib.get_close_matches(str(key), list(keys), n=1)
            hint = f" (did you mean {json.dumps(close[0])}?)" if close else f" (known keys: {', '.join(keys)})"
            raise JSONFileError(f"{_where(file, _join(path, str(key)))}: unknown key{hint}")
        if version is not None and keys[key].since > version:
            raise JSONFileError(
                f"{_where(file, _join(path, key))}: not part of format_version {version} (added in "
                f"{keys[key].since}); the file's format_version is wrong"
            )
    for key, field in keys.items():
        if key in data:
            check(data[key], field, file, _join(path, key), version)
        elif field.required and (version is None or field.since <= version):
            raise JSONFileError(f"{_where(file, path)}: missing key {json.dumps(key)} ({_expected(field)})")


# ---------------------------------------------------------------------------------------------------- formats
@dataclass(frozen=True)
class FormatSpec:
    """A file format: `name` (the `format` value), the newest `version` this code writes and reads (older ones
    still load), `legacy` names that stand for a version (e.g. {"balancer.plan/1": 1}, before format_version)."""

    name: str
    version: int
    legacy: Mapping[str, int] = None  # type: ignore[assignment]

    def header(self) -> dict:
        """The `format` / `format_version` keys a writer puts first."""
        return {"format": self.name, "format_version": self.version}


FORMAT_KEYS = {"format": string(required=False), "format_version": integer(min=1, required=False)}


def check_format(data: Any, file: str, spec: FormatSpec, required: bool = True) -> int:
    """The file's format_version after checking `format` (known name) and `format_version` (1..spec.version).
    A file without `format` is refused when `required`, else read as the current version."""
    if not isinstance(data, dict):
        raise JSONFileError(f"{file}: expected a JSON object, got {_show(data)}")
    name, version = data.get("format"), data.get("format_version")
    if name is None:
        if required:
            raise JSONFileError(f'{file}: missing key "format" (a {spec.name} file has "format": "{spec.name}")')
        if version is not None:
            raise JSONFileError(f'{file}: "format_version" without "format"')
        return spec.version
    legacy = dict(spec.legacy or {})
    if isinstance(name, str) and name in legacy:
        if version is not None:
            raise JSONFileError(f'{file}: "format_version": not used with the old format name {_show(name)}')
        return legacy[name]
    if name != spec.name:
        raise JSONFileError(f'{file}: "format": not a {spec.name} file (format {_show(name)})')
    if version is None:
        raise JSONFileError(f'{file}: missing key "format_version" (an integer 1..{spec.version})')
    check(version, integer(min=1), file, "format_version")
    if version > spec.version:
        raise JSONFileError(
            f'{file}: "format_version": {version} is newer than this balancer reads (up to {spec.version}); '
            "upgrade balancer"
        )
    return version
