"""Windowed planning: an epoch planned window by window, each window a contiguous block of the epoch's shuffle.

The epoch's shuffle is a keyed bijection of `[0, num_docs)` (a Feistel network over the next power of four, made
exact by cycle walking): the documents at shuffle positions `[a, b)` are computed in O(b - a) time and memory, with
no permutation of the whole epoch in memory. Window `i` holds the documents at positions
`[i * window_docs, (i + 1) * window_docs)`; the last window holds the rest (when the rest is under a quarter of a
window it joins the window before, so no window is too small to fill a step). A window is planned by
`balancer.plan` on its documents' lengths with a seed drawn from (seed, epoch, index), and its document ids are
mapped back to global ids: every rank computes the same window plan with no communication, and every document comes
exactly once per epoch. With one window (`window_docs >= num_docs`) the plan is `balancer.plan(lengths, ...,
seed=seed + epoch)`, the whole-epoch plan. Memory: O(window_docs); `lengths` is indexed, never copied whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from balancer.planning.cost import CostModel
from balancer.planning.planner import plan
from balancer.planning.plans import Plan
from balancer.planning.topology import Topology
from balancer.planning.units import OVERFLOW_POLICIES

__all__ = [
    "plan_window",
    "EpochShuffle",
    "WindowInfo",
    "num_windows",
    "window_range",
    "window_ids",
    "window_seed",
    "default_window_docs",
    "check_window_docs",
    "DEFAULT_WINDOW_STEPS",
    "MIN_DEFAULT_WINDOW_DOCS",
]

# The default window holds about this many steps' documents (and at least MIN_DEFAULT_WINDOW_DOCS): chosen from the
# quality-vs-memory curve of benchmarks/window_planning.py (docs/windows.md).
DEFAULT_WINDOW_STEPS = 64
MIN_DEFAULT_WINDOW_DOCS = 1 << 16

_ROUNDS = 6
_SHUFFLE_TAG = 0x77696E64  # keeps the shuffle's keys apart from any other use of (seed, epoch)
_PLAN_TAG = 0x706C616E
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on a uint64 array (wrapping arithmetic): the Feistel round function."""
    z = z ^ (z >> np.uint64(30))
    z = z * _M1
    z = z ^ (z >> np.uint64(27))
    z = z * _M2
    return z ^ (z >> np.uint64(31))


class EpochShuffle:
    """The shuffle of an epoch as a bijection `position -> document id` of `[0, num_docs)`, keyed by (seed, epoch).

    `shuffle(positions)` maps any positions in O(len(positions)); nothing of size `num_docs` is ever built."""

    def __init__(self, num_docs: int, seed: int, epoch: int) -> None:
        self.num_docs = int(num_docs)
        bits = max(2, (self.num_docs - 1).bit_length())
        self._half = np.uint64((bits + 1) // 2)
        self._mask = np.uint64((1 << int(self._half)) - 1)
        self._keys = np.random.SeedSequence([_SHUFFLE_TAG, int(seed), int(epoch)]).generate_state(_ROUNDS, np.uint64)

    def _permute(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self._half, x & self._mask
        for key in self._keys:
            left, right = right, left ^ (_mix(right ^ key) & self._mask)
        return (left << self._half) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        x = np.asarray(positions, dtype=np.uint64).copy()
        if len(x) and int(x.max()) >= self.num_docs:
            raise ValueError(f"shuffle positions must be below num_docs = {self.num_docs}")
        todo = np.arange(len(x))
        while len(todo):  # cycle walking: a value outside [0, num_docs) is permuted again until it lands inside
            x[todo] = self._permute(x[todo])
            todo = todo[x[todo] >= self.num_docs]
        return x.astype(np.int64)


@dataclass(frozen=True)
class WindowInfo:
    """Where a window plan sits in its epoch: window `index` of `num_windows`, shuffle positions [first, stop)."""

    epoch: int
    index: int
    num_windows: int
    window_docs: int
    first: int
    stop: int


def _check_int(value, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_window_docs(window_docs, topology: Topology | None = None) -> int:
    """`window_docs` as an int, or one error naming the argument: an integer, and at least the micro-batches of
    one step (dp * micro_batches) so that a window can fill a step."""
    value = _check_int(window_docs, "window_docs", 1)
    if topology is not None and value < topology.bins_per_step:
        raise ValueError(
            f"window_docs = {value} is below dp*micro_batches = {topology.bins_per_step}: a window must hold at least "
            "one document per micro-batch of a step"
        )
    return value


def num_windows(num_docs: int, window_docs: int) -> int:
    """Windows of an epoch of `num_docs` documents: ceil(num_docs / window_docs), less one when the rest is under a
    quarter window (it joins the window before)."""
    k = -(-int(num_docs) // int(window_docs))
    rest = num_docs - (k - 1) * window_docs
    return k - 1 if k > 1 and 4 * rest < window_docs else k


def window_range(num_docs: int, window_docs: int, index: int) -> tuple[int, int]:
    """Shuffle positions [first, stop) of window `index`."""
    k = num_windows(num_docs, window_docs)
    if not 0 <= index < k:
        raise ValueError(f"index {index} out of range: {num_docs} documents in windows of {window_docs} make {k}")
    first = index * window_docs
    return first, num_docs if index == k - 1 else first + window_docs


def window_ids(num_docs: int, seed: int, epoch: int, index: int, window_docs: int) -> np.ndarray:
    """Sorted global document ids of window `index` (O(window) time and memory)."""
    first, stop = window_range(num_docs, window_docs, index)
    if first == 0 and stop == num_docs:
        return np.arange(num_docs, dtype=np.int64)
    ids = EpochShuffle(num_docs, seed, epoch)(np.arange(first, stop, dtype=np.uint64))
    ids.sort()
    return ids


def window_seed(seed: int, epoch: int, index: int, windows: int) -> int:
    """The planner seed of a window: `seed + epoch` for a whole-epoch window (the whole-epoch plan), otherwise drawn
    from (seed, epoch, index)."""
    if windows == 1:
        return int(seed) + int(epoch)
    return int(np.random.SeedSequence([_PLAN_TAG, int(seed), int(epoch), int(index)]).generate_state(1)[0])


def default_window_docs(num_docs: int, total_tokens: int, topology: Topology) -> int:
    """The default window: the documents of about DEFAULT_WINDOW_STEPS steps (at the mean document length), at least
    MIN_DEFAULT_WINDOW_DOCS, at most the epoch."""
    per_step = topology.tokens_per_step * num_docs / max(1, total_tokens)
    return int(min(num_docs, max(MIN_DEFAULT_WINDOW_DOCS, np.ceil(DEFAULT_WINDOW_STEPS * per_step))))


def plan_window(
    lengths,
    topology: Topology,
    cost: CostModel,
    *,
    seed: int,
    epoch: int,
    index: int,
    window_docs: int,
    overflow: str = "error",
) -> Plan:
    """The plan of window `index` of the epoch (module docstring), document ids global.

    The returned plan's `lengths` are all of `lengths` (as int64: a view of an int64 array, a copy otherwise) and it
    places only the window's documents (`plan.window` says which: a `WindowInfo`; `plan.window_ids` lists them), so
    `plan.validate()` (whole-epoch coverage) does not apply to it unless the window is the whole epoch."""
    seed, epoch = _check_int(seed, "seed", 0), _check_int(epoch, "epoch", 0)
    index = _check_int(index, "index", 0)
    window_docs = check_window_docs(window_docs, topology if isinstance(topology, Topology) else None)
    if overflow not in OVERFLOW_POLICIES:
        raise ValueError(f"overflow must be one of {OVERFLOW_POLICIES}, got {overflow!r}")
    if not hasattr(lengths, "__len__") or not hasattr(lengths, "dtype"):
        lengths = np.asarray(lengths)
    n = len(lengths)
    k = num_windows(n, window_docs) if n else 1
    first, stop = window_range(n, window_docs, index) if n else (0, 0)
    info = WindowInfo(epoch, index, k, min(window_docs, n), first, stop)
    if k == 1:
        out = plan(lengths, topology, cost, seed=window_seed(seed, epoch, 0, 1), overflow=overflow)
        out.window, out.window_ids = info, np.arange(n, dtype=np.int64)
        return out
    ids = window_ids(n, seed, epoch, index, window_docs)
    local = plan(np.asarray(lengths[ids]), topology, cost, seed=window_seed(seed, epoch, index, k), overflow=overflow)
    out = globalise(local, ids, lengths)
    out.window, out.window_ids = info, ids
    return out


def globalise(local: Plan, ids: np.ndarray, lengths) -> Plan:
    """A plan over documents `ids` (local ids 0..len(ids)-1) as a plan with global ids over all of `lengths`."""
    groups = (local.group_start, local.group_size, local.slot_ptr) if local.dynamic else None
    return Plan(
        lengths,
        local.topology,
        local.cost_model,
        ids[local.doc],
        local.start,
        local.end,
        local.mb_ptr,
        seed=local.seed,
        plan_seconds=local.plan_seconds,
        dropped_tokens=local.dropped_tokens,
        groups=groups,
    )
