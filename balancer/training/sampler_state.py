"""Sampler resume states: the format and the strict check of every field (a state is untrusted input).

Version 2 (`{"format": "balancer.sampler", "format_version": 2, ...}`) adds the window size and the window the
position is in (`window_docs`, `window`). Version 1 (`{"format": "balancer.sampler/1", ...}`, no `format_version`)
still loads: it is a whole-epoch plan, one window. Exact types (a bool is not an integer), no unknown keys.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from balancer.planning.cost import CostModel
from balancer.planning.topology import Topology
from balancer.planning.units import OVERFLOW_POLICIES
from balancer.planning.window import num_windows

STATE_FORMAT = "balancer.sampler"
STATE_VERSION = 2
LEGACY_FORMAT = "balancer.sampler/1"  # version 1 named its version in `format`

_REQUIRED = ("epoch", "position", "seed", "overflow", "fingerprint", "num_docs", "segments")
_OPTIONAL = ("dp_rank", "rank")
_V2 = ("format_version", "window_docs", "window")
_SEGMENT_KEYS = {"topology", "cost", "steps"}


def _state_int(state: dict, key: str, minimum: Optional[int], where: str = "") -> int:
    value = state[key]
    name = f"{where}.{key}" if where else key
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"sampler state field '{name}' must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"sampler state field '{name}' = {value} is below {minimum}: the state is corrupt")
    return int(value)


def _version(state: dict) -> int:
    fmt = state.get("format")
    if fmt == LEGACY_FORMAT and "format_version" not in state:
        return 1
    if fmt != STATE_FORMAT:
        raise ValueError(f"not a BalancedBatchSampler state (format {fmt!r})")
    if "format_version" not in state:
        raise ValueError("sampler state has no 'format_version' field")
    version = _state_int(state, "format_version", 1)
    if version > STATE_VERSION:
        raise ValueError(
            f"sampler state format_version {version} is newer than this balancer reads ({STATE_VERSION}): upgrade"
        )
    return version


def check_state(state) -> dict:
    """Validate every field of a sampler state (types, ranges, segment records); returns it with topologies and
    cost models parsed and, for a version-1 state, `window_docs` None (the whole epoch) and `window` 0. Raises one
    ValueError naming the field."""
    if not isinstance(state, dict):
        raise ValueError(f"not a BalancedBatchSampler state (a {type(state).__name__}, not a dict)")
    version = _version(state)
    required = _REQUIRED + (_V2 if version >= 2 else ())
    missing = [k for k in required if k not in state]
    if missing:
        raise ValueError(f"sampler state has no '{missing[0]}' field")
    unknown = sorted(set(state) - set(required) - set(_OPTIONAL) - {"format"})
    if unknown:
        raise ValueError(f"sampler state has an unknown field '{unknown[0]}' (format_version {version})")
    out = dict(state)
    for key in ("epoch", "position", "seed", "num_docs") + (("window",) if version >= 2 else ()):
        out[key] = _state_int(state, key, 0)
    for key in _OPTIONAL:
        if key in state:
            out[key] = _state_int(state, key, 0)
    out["window_docs"], out["window"] = None, out.get("window", 0)
    if version >= 2:
        out["window_docs"] = _state_int(state, "window_docs", 1)
        windows = num_windows(out["num_docs"], out["window_docs"]) if out["num_docs"] else 1
        if out["window"] >= windows:
            raise ValueError(
                f"sampler state field 'window' = {out['window']} is out of range: {out['num_docs']} documents in "
                f"windows of {out['window_docs']} make {windows}"
            )
    if not isinstance(state["overflow"], str) or state["overflow"] not in OVERFLOW_POLICIES:
        raise ValueError(f"sampler state field 'overflow' = {state['overflow']!r} is not one of {OVERFLOW_POLICIES}")
    if not isinstance(state["fingerprint"], str):
        raise ValueError(f"sampler state field 'fingerprint' must be a string, got {state['fingerprint']!r}")
    out["segments"] = _check_segments(state["segments"])
    return out


def _check_segments(segs) -> list[dict]:
    if not isinstance(segs, list) or not segs:
        raise ValueError("sampler state field 'segments' must be a non-empty list")
    parsed = []
    for i, seg in enumerate(segs):
        where = f"segments[{i}]"
        if not isinstance(seg, dict) or set(seg) != _SEGMENT_KEYS:
            raise ValueError(f"sampler state field '{where}' must be an object with exactly topology, cost and steps")
        try:
            topology, cost = Topology.from_dict(seg["topology"]), CostModel.from_dict(seg["cost"])
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"sampler state field '{where}': {e}") from None
        last = i == len(segs) - 1
        if last and seg["steps"] is not None:
            raise ValueError(f"sampler state field '{where}.steps' must be null (the segment in use)")
        steps = None if last else _state_int(seg, "steps", 0, where)
        parsed.append({"topology": topology, "cost": cost, "steps": steps})
    return parsed
