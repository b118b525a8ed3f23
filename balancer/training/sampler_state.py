"""Sampler resume states: the format and the check of every field (a state is untrusted input)."""

from __future__ import annotations

from typing import Optional

import numpy as np

from balancer.planning.cost import CostModel
from balancer.planning.topology import Topology
from balancer.planning.units import OVERFLOW_POLICIES

STATE_FORMAT = "balancer.sampler/1"

_STATE_INTS = ("epoch", "position", "seed", "num_docs")


def _state_int(state: dict, key: str, minimum: Optional[int]) -> int:
    value = state[key]
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"sampler state field '{key}' must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"sampler state field '{key}' = {value} is below {minimum}: the state is corrupt")
    return int(value)


def check_state(state) -> dict:
    """Validate every field of a sampler state (types, ranges, segment records); returns it with topologies and
    cost models parsed. Raises one ValueError naming the field."""
    if not isinstance(state, dict):
        raise ValueError(f"not a BalancedBatchSampler state (a {type(state).__name__}, not a dict)")
    if state.get("format") != STATE_FORMAT:
        raise ValueError(f"not a BalancedBatchSampler state (format {state.get('format')!r})")
    required = ("epoch", "position", "seed", "overflow", "fingerprint", "num_docs", "segments")
    missing = [k for k in required if k not in state]
    if missing:
        raise ValueError(f"sampler state has no '{missing[0]}' field")
    out = dict(state)
    for key in _STATE_INTS:
        out[key] = _state_int(state, key, None if key == "seed" else 0)
    if state["overflow"] not in OVERFLOW_POLICIES:
        raise ValueError(f"sampler state field 'overflow' = {state['overflow']!r} is not one of {OVERFLOW_POLICIES}")
    if not isinstance(state["fingerprint"], str):
        raise ValueError(f"sampler state field 'fingerprint' must be a string, got {state['fingerprint']!r}")
    segs = state["segments"]
    if not isinstance(segs, list) or not segs:
        raise ValueError("sampler state field 'segments' must be a non-empty list")
    parsed = []
    for i, seg in enumerate(segs):
        where = f"segments[{i}]"
        if not isinstance(seg, dict) or not {"topology", "cost", "steps"} <= set(seg):
            raise ValueError(f"sampler state field '{where}' must be an object with topology, cost and steps")
        try:
            topology, cost = Topology.from_dict(seg["topology"]), CostModel.from_dict(seg["cost"])
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"sampler state field '{where}': {e}") from None
        last = i == len(segs) - 1
        steps = None if last and seg["steps"] is None else _state_int(seg, "steps", 0)
        if not last and steps is None:
            raise ValueError(f"sampler state field '{where}.steps' must be an integer")
        parsed.append({"topology": topology, "cost": cost, "steps": steps})
    out["segments"] = parsed
    return out
