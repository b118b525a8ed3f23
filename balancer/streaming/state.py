"""`BalancedStream` resume states: what one holds, its strict check, and the one-line refusals of a mismatch.

A state is the same on every rank that saves it after the same micro-batch, and saving it needs no communication:
everything in it was shared by the window gathers. It holds

- `epoch`, `seed`, `overflow`, `window_docs`, `source` (the source's kind and parts): must match the stream;
- `window` (its index) and `streams`: every stream `[part, stride, offset, pos, ended]` as it stood before that
  window (`pos` items of it in earlier windows); `taken` (items of each stream in the window) and `ended_after`,
  or null when the window was not read yet; `digest`, a digest of the window's lengths (a resumed window must
  re-read the same documents: anything else means the source changed);
- `position`: micro-batches of the window's current plan segment consumed; `segments`: the chain of (topology,
  cost model, steps consumed) the window was planned with, as in the sampler's state (the last one in use, its
  `steps` null), so that a resume on another topology re-plans what is left of the window (the chain, its schema
  and the mid-step rule: balancer.planning.schedule);
- `models`: the cost models and rank speeds `update_model` scheduled, each from its `first_window` on (the
  stream's `WindowSchedule`);
- `step` (optional, 0 when absent): the epoch's steps before the window's current segment (what an attached
  `BalanceMonitor` counts steps from); `monitor` (optional): that monitor's state (balancer.measured.streams).

Resuming re-reads the window from the streams' positions (a stream that cannot seek reads its first `pos` items
again and skips them) and re-plans it, so the continuation equals the uninterrupted run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from balancer.planning.schedule import MODEL_CHANGE, SEED, SEGMENT, parse_segments
from balancer.planning.units import OVERFLOW_POLICIES

if TYPE_CHECKING:
    from balancer.streaming.dataset import BalancedStream
from balancer.strict_json import (
    FORMAT_KEYS,
    FormatSpec,
    anything,
    array,
    check,
    check_format,
    integer,
    obj,
    string,
)

SPEC = FormatSpec("balancer.stream", 1)
WHERE = "stream state"

_STATE = obj(
    {
        **FORMAT_KEYS,
        "epoch": integer(min=0),
        "seed": SEED,
        "overflow": string(choices=OVERFLOW_POLICIES),
        "window_docs": integer(min=1),
        "source": string(),
        "window": integer(min=0),
        "streams": array(array(integer(min=0), max_items=5)),
        "taken": array(integer(min=0), nullable=True),
        "ended_after": array(integer(min=0, max=1), nullable=True),
        "digest": string(nullable=True),
        "position": integer(min=0),
        "step": integer(min=0, required=False),  # steps of the epoch before the window's current segment
        "segments": array(SEGMENT),
        "models": array(MODEL_CHANGE),  # WindowSchedule.changes_state: read by WindowSchedule.load_changes
        "monitor": anything(required=False),  # a BalanceMonitor's state (balancer.measured.streams), checked there
    }
)


def check_state(state: object) -> dict:
    """Validate every field of a stream state; returns a copy with the segments' topologies and cost models parsed
    (the models' are read by `WindowSchedule.load_changes`). Raises one ValueError naming the field."""
    if not isinstance(state, dict):
        raise ValueError(f"not a BalancedStream state (a {type(state).__name__}, not a dict)")
    try:
        check_format(state, WHERE, SPEC)
    except ValueError as e:
        raise ValueError(f"not a BalancedStream state: {e}") from None
    check(state, _STATE, WHERE)
    out = dict(state)
    n = len(state["streams"])
    if n == 0:
        raise ValueError(f'{WHERE}: "streams": expected a non-empty list')
    for i, row in enumerate(state["streams"]):
        if len(row) != 5 or row[1] < 1 or row[4] > 1:
            raise ValueError(
                f'{WHERE}: "streams[{i}]": expected [part, stride >= 1, offset, pos, ended 0/1], got {row}'
            )
    for key in ("taken", "ended_after", "digest"):
        if (state[key] is None) != (state["taken"] is None):
            raise ValueError(f'{WHERE}: "{key}": must be null exactly when "taken" is null')
    for key in ("taken", "ended_after"):
        if state[key] is not None and len(state[key]) != n:
            raise ValueError(f'{WHERE}: "{key}": {len(state[key])} entries for {n} streams')
    out["segments"] = parse_segments(state["segments"], WHERE)
    return out


def check_match(state: dict, stream: BalancedStream) -> None:
    """One ValueError naming the first field in which `state` (checked) and `stream` differ."""
    for key, mine in (
        ("seed", stream.seed),
        ("overflow", stream.overflow),
        ("window_docs", stream.window_docs),
        ("source", stream.source.fingerprint),
    ):
        if state[key] != mine:
            raise ValueError(f"the state is from {key}={state[key]!r}, this stream has {key}={mine!r}")
    parts = stream.source.num_parts
    for i, row in enumerate(state["streams"]):
        if row[0] >= parts:
            raise ValueError(f"the state's stream {i} reads part {row[0]}, the source has {parts} parts")


def header() -> dict:
    return SPEC.header()
