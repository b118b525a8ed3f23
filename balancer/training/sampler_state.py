"""Sampler resume states: the format and the strict check of every field (a state is untrusted input).

Version 3 (`{"format": "balancer.sampler", "format_version": 3, ...}`) adds `digest`: a hash of everything that
decides which documents were consumed and which come next (the lengths' fingerprint and count, seed, epoch, overflow
policy, window size, window, position and the segments: topology, cost model, steps consumed). A state whose fields
no longer match its digest was edited or corrupted after it was saved and is refused: resuming from it would skip
or repeat documents. Version 2 adds the window size and the window the position is in (`window_docs`, `window`).
Versions 1 (`{"format": "balancer.sampler/1", ...}`, no `format_version`: a whole-epoch plan, one window) and 2
still load, without a digest to check. Exact types (a bool is not an integer), no unknown keys
(balancer.strict_json). The segment chain's schema, the seed rule and the mid-step rule are
balancer.planning.schedule's (the stream's states share them).
"""

from __future__ import annotations

import hashlib
import json
import os

from balancer.planning.schedule import SEED, SEGMENT, parse_segments
from balancer.planning.shuffle import num_windows
from balancer.planning.units import OVERFLOW_POLICIES
from balancer.strict_json import FORMAT_KEYS, FormatSpec, anything, array, check, check_format, integer, obj, string

SPEC = FormatSpec("balancer.sampler", 3, legacy={"balancer.sampler/1": 1})
DIGESTED = ("fingerprint", "num_docs", "seed", "epoch", "overflow", "window_docs", "window", "position", "segments")
STATE_FORMAT, STATE_VERSION = SPEC.name, SPEC.version
WHERE = "sampler state"

_STATE = obj(
    {
        **FORMAT_KEYS,
        "epoch": integer(min=0),
        "position": integer(min=0),
        "seed": SEED,
        "overflow": string(choices=OVERFLOW_POLICIES),
        "fingerprint": string(),
        "num_docs": integer(min=1),
        "dp_rank": integer(min=0, required=False),
        "rank": integer(min=0, required=False),
        "window_docs": integer(min=1, since=2),
        "window": integer(min=0, since=2),
        "segments": array(SEGMENT),
        "monitor": anything(required=False),  # a BalanceMonitor's state (balancer.measured), checked there
        "digest": string(since=3),
    }
)


def state_digest(state: dict) -> str:
    """The digest of a state's order- and position-deciding fields (DIGESTED), as saved (plain JSON values)."""
    payload = json.dumps({k: state.get(k) for k in DIGESTED}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def check_state(state: object) -> dict:
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
    out["segments"] = parse_segments(state["segments"], WHERE)
    if version >= 3 and state["digest"] != state_digest(state):
        shown = ", ".join(f"{k} {state[k]}" for k in ("epoch", "window_docs", "window", "position", "seed"))
        raise ValueError(
            f"{WHERE}: its fields do not match its digest: the state was edited or corrupted after it was saved "
            f"({shown}, {len(state['segments'])} segment(s)); resuming from it would skip or repeat documents. Use "
            "the state the sampler wrote"
        )
    return out


def read_checkpoint_state(checkpoint: str, name: str, writer: str, instead: str) -> tuple[str, dict]:
    """(path, the JSON state) of `name` a balanced trainer saved in `checkpoint`; a checkpoint without it is refused
    naming the file, the `writer` it would come from and what `ignore_data_skip=True` does `instead`."""
    path = os.path.join(checkpoint, name)
    if not os.path.isfile(path):
        raise ValueError(
            f"{checkpoint}: no {name} (not a checkpoint of {writer}); pass ignore_data_skip=True in the "
            f"TrainingArguments to {instead} instead"
        )
    with open(path, encoding="utf-8") as f:
        return path, json.load(f)
