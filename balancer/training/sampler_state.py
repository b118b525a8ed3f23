"""Sampler resume states: the format and the strict check of every field (a state is untrusted input).

Version 2 (`{"format": "balancer.sampler", "format_version": 2, ...}`) adds the window size and the window the
position is in (`window_docs`, `window`). Version 1 (`{"format": "balancer.sampler/1", ...}`, no `format_version`)
still loads: it is a whole-epoch plan, one window. Exact types (a bool is not an integer), no unknown keys
(balancer.strict_json).
"""

from __future__ import annotations

from balancer.planning.cost.model import CostModel
from balancer.planning.shuffle import num_windows
from balancer.planning.topology import Topology
from balancer.planning.units import OVERFLOW_POLICIES
from balancer.strict_json import FORMAT_KEYS, FormatSpec, anything, array, check, check_format, integer, obj, string

SPEC = FormatSpec("balancer.sampler", 2, legacy={"balancer.sampler/1": 1})
STATE_FORMAT, STATE_VERSION = SPEC.name, SPEC.version
WHERE = "sampler state"

_SEGMENT = obj({"topology": anything(), "cost": anything(), "steps": integer(min=0, nullable=True)})
_STATE = obj(
    {
        **FORMAT_KEYS,
        "epoch": integer(min=0),
        "position": integer(min=0),
        "seed": integer(min=0),
        "overflow": string(choices=OVERFLOW_POLICIES),
        "fingerprint": string(),
        "num_docs": integer(min=1),
        "dp_rank": integer(min=0, required=False),
        "rank": integer(min=0, required=False),
        "window_docs": integer(min=1, since=2),
        "window": integer(min=0, since=2),
        "segments": array(_SEGMENT),
        "monitor": anything(required=False),  # a BalanceMonitor's state (balancer.measured), checked there
    }
)


def check_state(state) -> dict:
    """Validate every field of a sampler state (types, ranges, segment records); returns a copy with topologies and
    cost models parsed and, for a version-1 state, `window_docs` None (the whole epoch) and `window` 0. Raises one
    ValueError naming the field."""
    if not isinstance(state, dict):
        raise ValueError(f"not a BalancedBatchSampler state (a {type(state).__name__}, not a dict)")
    try:
        version = check_format(state, WHERE, SPEC)
    except ValueError as e:
        raise ValueError(f"not a BalancedBatchSampler state: {e}") from None
    check(state, _STATE, WHERE, version=version)
    out = dict(state)
    out.setdefault("window_docs", None)
    out.setdefault("window", 0)
    if version >= 2:
        windows = num_windows(out["num_docs"], out["window_docs"])
        if out["window"] >= windows:
            raise ValueError(
                f'{WHERE}: "window": {out["window"]} is out of range: {out["num_docs"]} documents in windows of '
                f"{out['window_docs']} make {windows}"
            )
    out["segments"] = _parse_segments(state["segments"])
    return out


def _parse_segments(segs: list) -> list[dict]:
    if not segs:
        raise ValueError(f'{WHERE}: "segments": expected a non-empty list')
    parsed = []
    for i, seg in enumerate(segs):
        where = f"segments[{i}]"
        try:
            topology, cost = Topology.from_dict(seg["topology"]), CostModel.from_dict(seg["cost"])
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f'{WHERE}: "{where}": {e}') from None
        last = i == len(segs) - 1
        if last != (seg["steps"] is None):
            what = "null (the segment in use)" if last else "the steps consumed (an integer)"
            raise ValueError(f'{WHERE}: "{where}.steps": expected {what}, got {seg["steps"]!r}')
        parsed.append({"topology": topology, "cost": cost, "steps": seg["steps"]})
    return parsed
