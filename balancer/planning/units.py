"""Planning units: validated document lengths, cut into the pieces the planner places (whole documents, windows
of split documents, or truncated documents)."""

from __future__ import annotations

import logging

import numpy as np
from numpy.typing import ArrayLike

from balancer.planning.cost.model import CostModel
from balancer.planning.topology import Topology

OVERFLOW_POLICIES = ("error", "split", "truncate")
MAX_SPLIT_WINDOWS = 1 << 20  # overflow="split" makes at most this many windows in all (planning work grows with them)
log = logging.getLogger(__name__)
_logged: set = set()  # decisions already reported: each is logged once per process, not once per epoch


def _log_once(key: tuple, level: int, message: str, *args) -> None:
    if key not in _logged:
        _logged.add(key)
        log.log(level, message, *args)


def check_topology_and_cost(topology: object, cost: object) -> None:
    """A TypeError naming the argument unless `topology` is a `balancer.Topology` and `cost` a `balancer.CostModel`."""
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a balancer.Topology, got {type(topology).__name__}")
    if not isinstance(cost, CostModel):
        raise TypeError(f"cost must be a balancer.CostModel, got {type(cost).__name__}")


def validate_lengths(lengths: ArrayLike, name: str = "lengths") -> np.ndarray:
    """1-D positive integer lengths as int64, or a ValueError naming the first bad document."""
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array of document lengths, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{name} is empty: there is nothing to plan")
    if arr.dtype.kind not in "iuf":
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "f":
        bad = ~np.isfinite(arr) | (arr != np.round(arr))
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"{name}[{i}] = {arr[i].item()!r} is not an integer token count (document {i})")
    bad = arr <= 0
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"{name}[{i}] = {arr[i].item()} : document {i} has no tokens (lengths must be >= 1)")
    return arr.astype(np.int64)


def planning_units(
    lengths: np.ndarray, cap: int, overflow: str, topology: Topology
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut documents into planning units `(doc, start, end)` honouring the overflow policy."""
    if overflow not in OVERFLOW_POLICIES:
        raise ValueError(f"overflow must be one of {OVERFLOW_POLICIES}, got {overflow!r}")
    n = len(lengths)
    over = lengths > cap
    if not over.any():
        return np.arange(n), np.zeros(n, dtype=np.int64), lengths.copy()
    if overflow == "error":
        i = int(np.argmax(lengths * over))
        raise ValueError(
            f"document {i} has {lengths[i]} tokens, more than a micro-batch holds: max_tokens*cp = "
            f"{topology.max_tokens}*{topology.cp} = {cap} ({int(over.sum())} documents are over); raise "
            f"max_tokens or cp, or pass overflow='split' (windows) or 'truncate'"
        )
    if overflow == "truncate":
        dropped = int((lengths - cap)[over].sum())
        key = ("truncate", int(over.sum()), cap, dropped)
        _log_once(
            key, logging.WARNING, "overflow='truncate': %d documents cut to %d tokens, %d tokens dropped", *key[1:]
        )
        return np.arange(n), np.zeros(n, dtype=np.int64), np.minimum(lengths, cap)
    pieces = np.where(over, -(-lengths // cap), 1)
    windows = int(pieces[over].sum())
    if windows > MAX_SPLIT_WINDOWS:
        i = int(np.argmax(pieces))
        raise ValueError(
            f"document {i} has {lengths[i]} tokens: split into windows of max_tokens*cp = {cap} tokens it alone "
            f"makes {int(pieces[i])} windows ({windows} for all split documents), over the limit of "
            f"{MAX_SPLIT_WINDOWS} windows that bounds planning time and memory; check the lengths, raise max_tokens "
            "or cp, or pass overflow='truncate'"
        )
    key = ("split", int(over.sum()), windows, cap)
    _log_once(key, logging.INFO, "overflow='split': %d documents cut into %d windows of at most %d tokens", *key[1:])
    doc = np.repeat(np.arange(n), pieces)
    first = np.cumsum(pieces) - pieces
    start = (np.arange(len(doc)) - np.repeat(first, pieces)) * cap
    end = np.minimum(start + cap, lengths[doc])
    return doc, start, end
