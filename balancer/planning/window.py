"""Windowed planning: an epoch planned window by window, each window a contiguous block of the epoch's shuffle.

The epoch's shuffle is a keyed bijection of `[0, num_docs)` (balancer.planning.shuffle): the documents at shuffle
positions `[a, b)` are computed in O(b - a) time and memory, with no permutation of the whole epoch in memory. Window
`i` holds the documents at positions
`[i * window_docs, (i + 1) * window_docs)`; the last window holds the rest (when the rest is under a quarter of a
window it joins the window before, so no window is too small to fill a step). A window is planned by
`balancer.plan` on its documents' lengths with a seed drawn from (seed, epoch, index), and its document ids are
mapped back to global ids: every rank computes the same window plan with no communication, and every document comes
exactly once per epoch. With one window (`window_docs >= num_docs`) the plan is `balancer.plan(lengths, ...,
seed=seed + epoch)`, the whole-epoch plan. Memory: O(window_docs); `lengths` is indexed, never copied whole.
"""

from __future__ import annotations

import numpy as np

from balancer.planning.cost.model import CostModel
from balancer.planning.dynamic.plan import largest_group_topology
from balancer.planning.packing.bestfit import SMALL_CLASSES, best_fit_count, class_sums, fit_bound
from balancer.planning.planner import plan
from balancer.planning.plans.plan import Plan
from balancer.planning.shuffle import EpochShuffle, WindowInfo, num_windows, window_ids, window_range
from balancer.planning.speeds import even
from balancer.planning.steps import (
    STEP_BAND,
    effective_step_tokens,
    equal_row_cut,
    equal_row_steps,
    fixed_step_count,
    step_token_targets,
    unit_stats,
)
from balancer.planning.topology import Topology
from balancer.planning.units import OVERFLOW_POLICIES, planning_units, validate_lengths

__all__ = [
    "plan_window",
    "plan_steps_bound",
    "window_step_count",
    "window_step_counts",
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

_PLAN_TAG = 0x706C616E
MAX_SEED = 2**63 - 1  # plan files and sampler states hold int64 seeds and epochs


def _check_int(value, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_window_docs(window_docs: object, topology: Topology | None = None, num_docs: int | None = None) -> int:
    """`window_docs` as an int, or one error naming the argument: an integer, at least the micro-batches of one step
    (dp * micro_batches; with dynamic CP those of the smallest size) so that a window can fill a step and, given
    `num_docs`, a size whose last window can fill one too (the rest of an epoch under a quarter window joins the
    window before; a larger rest that cannot fill a step is refused here, up front)."""
    value = _check_int(window_docs, "window_docs", 1)
    if topology is None:
        return value
    nb = count_topology(topology).bins_per_step
    if value < nb:
        raise ValueError(
            f"window_docs = {value} is below dp*micro_batches = {nb}: a window must hold at least one document per "
            "micro-batch of a step"
        )
    if num_docs is not None and value < num_docs:
        k = num_windows(num_docs, value)
        last = num_docs - (k - 1) * value
        if last < nb:
            raise ValueError(
                f"window_docs = {value} leaves a last window of {last} of the {num_docs} documents, fewer than the "
                f"dp*micro_batches = {nb} micro-batches of a step: choose window_docs of at least {4 * nb} (a rest "
                "under a quarter window joins the window before) or one that leaves a larger rest"
            )
    return value


def window_seed(seed: int, epoch: int, index: int, windows: int) -> int:
    """The planner seed of a window: `seed + epoch` for a whole-epoch window (the whole-epoch plan), otherwise drawn
    from (seed, epoch, index)."""
    if windows == 1:
        return int(seed) + int(epoch)
    return int(np.random.SeedSequence([_PLAN_TAG, int(seed), int(epoch), int(index)]).generate_state(1)[0])


def default_window_docs(num_docs: int, total_tokens: int, topology: Topology) -> int:
    """The default window: the documents of about DEFAULT_WINDOW_STEPS steps (at the mean document length), at least
    MIN_DEFAULT_WINDOW_DOCS, at most the epoch."""
    per_step = topology.step_tokens * num_docs / max(1, total_tokens)
    return int(min(num_docs, max(MIN_DEFAULT_WINDOW_DOCS, np.ceil(DEFAULT_WINDOW_STEPS * per_step))))


def plan_window(
    lengths: np.ndarray,
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
    places only the window's documents (`plan.window` says which: a `WindowInfo`, saved with the plan; `plan.window_ids`
    lists them); `plan.validate()` checks that exactly those documents are covered."""
    seed, epoch = _check_int(seed, "seed", 0), _check_int(epoch, "epoch", 0)
    if seed > MAX_SEED or epoch > MAX_SEED:
        name, value = ("seed", seed) if seed > MAX_SEED else ("epoch", epoch)
        raise ValueError(f"{name} must be at most 2**63-1 (what a plan file holds), got {value}")
    index = _check_int(index, "index", 0)
    n = len(lengths) if hasattr(lengths, "__len__") else None
    window_docs = check_window_docs(window_docs, topology if isinstance(topology, Topology) else None, n)
    if overflow not in OVERFLOW_POLICIES:
        raise ValueError(f"overflow must be one of {OVERFLOW_POLICIES}, got {overflow!r}")
    if not hasattr(lengths, "__len__") or not hasattr(lengths, "dtype"):
        lengths = np.asarray(lengths)
    n = len(lengths)
    k = num_windows(n, window_docs) if n else 1
    first, stop = window_range(n, window_docs, index) if n else (0, 0)
    info = WindowInfo(seed, epoch, index, k, min(window_docs, n), first, stop)
    if k == 1:
        out = plan(lengths, topology, cost, seed=window_seed(seed, epoch, 0, 1), overflow=overflow)
        out.window = info
        return out
    ids = window_ids(n, seed, epoch, index, window_docs)
    window_lengths = np.asarray(lengths[ids])
    steps = window_step_count(window_lengths, topology, overflow)
    local = plan(
        window_lengths, topology, cost, seed=window_seed(seed, epoch, index, k), overflow=overflow, num_steps=steps
    )
    return globalise(local, ids, lengths, info)


def unit_cap(topology: Topology) -> int:
    """The most tokens of one planning unit: a micro-batch (`max_tokens * cp`), with dynamic CP the largest group's."""
    return topology.max_tokens * topology.largest_group if topology.dynamic else topology.micro_batch_tokens


def count_topology(topology: Topology) -> Topology:
    """The topology a window's step count is computed on: itself, or with dynamic CP the pool as replicas of the
    smallest size (the most micro-batches a step may have), whichever size the planner balances on."""
    if not topology.dynamic:
        return topology
    return largest_group_topology(even(topology), min(topology.group_sizes))  # speeds never change a count


def rows_per_step(length: int, topology: Topology) -> int:
    """The most units of `length` tokens a step holds whole (with dynamic CP: on the size that holds fewest)."""
    sizes = (
        [c for c in topology.group_sizes if c * topology.max_tokens >= length] if topology.dynamic else [topology.cp]
    )
    per = [(topology.pool_size // c if topology.dynamic else topology.dp) * topology.micro_batches
           * (c * topology.max_tokens // length) for c in sizes]  # fmt: skip
    return max(1, min(per)) if per else 1


def step_count(stats: tuple, topology: Topology) -> int:
    """A window's step count (`fixed_step_count`) from its planning units' token total, number, number over half a
    unit's cap, common length (None when they have several) and tokens per small class (`class_sums`); a ValueError
    naming `window_docs` when no count fits them (too few documents for a step, or more than the steps that many
    documents can fill hold). The count before `packed_cut` (which may raise it where the units fragment)."""
    return step_cut(stats, topology)[0]


def step_cut(stats: tuple, topology: Topology) -> tuple[int, int]:
    """(steps, micro-batches of the last step) of a window from its units' statistics (`step_count`):
    `fixed_step_count`'s steps, all of `micro_batches`; fixed-length rows that no such count holds get
    `equal_row_cut`'s steps, the last one short (M' < micro_batches on every replica; static CP only)."""
    try:
        return _step_count(stats, topology), topology.micro_batches
    except ValueError:
        total, units, big, common = stats[:4]
        if common is None or topology.dynamic or units < count_topology(topology).bins_per_step:
            raise  # a window with fewer units than a step's micro-batches: refused (check_window_docs names it)
        rows, m_last = equal_row_cut(units, common, topology)
        return len(rows), m_last


def _step_count(stats: tuple, topology: Topology) -> int:
    total, units, big, common = stats[:4]
    counted = count_topology(topology)
    nb = counted.bins_per_step
    if units < nb:
        raise ValueError(
            f"a window of {units} documents cannot fill the dp*micro_batches = {nb} micro-batches of a step; raise "
            "window_docs"
        )
    rows = None if common is None else rows_per_step(common, topology)
    big = 0 if topology.dynamic else big
    steps = fixed_step_count(total, units, big, rows, counted)
    if total > steps * topology.capacity or big > steps * nb or (rows and units > steps * rows):
        raise ValueError(
            f"a window of {units} documents holding {total} tokens cannot be planned: the {steps} steps its documents "
            f"can fill ({nb} non-empty micro-batches each, dp*cp*micro_batches*max_tokens = {topology.capacity} "
            f"tokens) cannot hold them whole; raise window_docs"
        )
    return steps


def window_step_count(lengths: np.ndarray, topology: Topology, overflow: str = "error") -> int:
    """The steps a window of documents `lengths` is planned into (`plan_window`, the sampler): from the documents
    and the token budget alone, never the cost model or rank speeds (`fixed_step_count`)."""
    return window_cut(lengths, topology, overflow)[0]


def window_cut(lengths: np.ndarray, topology: Topology, overflow: str = "error") -> tuple[int, int]:
    """(`window_step_count`, micro-batches of the window's last step: M, or M' < M when its fixed-length rows
    cannot fill it; `step_cut`, then `packed_cut`)."""
    lengths = validate_lengths(lengths)
    _, u_start, u_end = planning_units(lengths, unit_cap(topology), overflow, topology)
    u_tok = u_end - u_start
    total, units, big, low, high = unit_stats(u_tok, unit_cap(topology))
    stats = (total, units, big, low if low == high else None, class_sums(u_tok, unit_cap(topology)))
    return packed_cut(stats, step_cut(stats, topology), topology, u_tok)


def may_fragment(stats: tuple, cut: tuple[int, int], topology: Topology) -> bool:
    """Whether `fit_bound` cannot prove that best-fit-decreasing packs the window's units into the micro-batches of
    `cut` (static CP, units of several lengths: fixed-length rows are dealt exactly, dynamic CP is left as counted)."""
    total, units, big, common, small = stats
    if topology.dynamic or common is not None:
        return False
    return fit_bound(total, units, big, small, unit_cap(topology)) > cut[0] * topology.bins_per_step


def packed_cut(stats: tuple, cut: tuple[int, int], topology: Topology, u_tok: np.ndarray) -> tuple[int, int]:
    """`cut` (from `step_cut`), raised to the steps whose micro-batches best-fit-decreasing fills where the units
    may fragment (`may_fragment`: units near the micro-batch size leave room no other unit fits, so the tokens
    alone undercount): every window then has a count its units provably fit (the planner's settling falls back on
    that packing); a ValueError naming `window_docs` when that count has more micro-batches than units."""
    if not may_fragment(stats, cut, topology):
        return cut
    nb = topology.bins_per_step
    steps = -(-best_fit_count(u_tok, unit_cap(topology)) // nb)
    if steps <= cut[0]:
        return cut
    if steps * nb > len(u_tok):
        raise ValueError(
            f"a window of {len(u_tok)} documents cannot be planned: they fragment the micro-batches of "
            f"max_tokens*cp = {unit_cap(topology)} tokens so that {steps} steps of dp*micro_batches = {nb} are needed, "
            "more micro-batches than documents; raise window_docs"
        )
    return steps, topology.micro_batches


def window_step_counts(
    lengths: np.ndarray,
    topology: Topology,
    *,
    seed: int,
    epoch: int,
    window_docs: int,
    overflow: str = "error",
    chunk: int = 1 << 20,
    last_micro_batches: np.ndarray | None = None,
) -> np.ndarray:
    """Every window's `window_step_count` in one chunked pass over `lengths` (read in order, never gathered): each
    document's window from the inverse of the epoch's shuffle, its units' statistics summed per window; a window
    whose units may fragment (`may_fragment`) is then gathered and counted by `window_cut`. O(n) time, O(chunk +
    windows) memory (O(window_docs) more for a gathered window); the same counts as planning each window's documents
    would give. `last_micro_batches` (an int array of one entry per window), when given, receives each window's
    last-step micro-batches (`step_cut`)."""
    n = len(lengths)
    window_docs = min(int(window_docs), n)
    k = num_windows(n, window_docs)
    acc = _WindowStats(k, unit_cap(topology), overflow == "split")
    runs = ((first, np.asarray(lengths[first : first + chunk], dtype=np.int64)) for first in range(0, n, chunk))
    if k == 1:
        for _, raw in runs:
            acc.add(np.zeros(len(raw), dtype=np.intp), raw)
    else:
        for positions, raw in EpochShuffle(n, seed, epoch).positions_of_runs(runs):
            win = positions // window_docs
            np.minimum(win, k - 1, out=win)
            acc.add(win, raw)
    counts = np.zeros(k, dtype=np.int64)
    for w in range(k):
        first, stop = window_range(n, window_docs, w)
        try:
            stats = acc.window(w, stop - first)
            counts[w], last = cut = step_cut(stats, topology)
            if may_fragment(stats, cut, topology):
                ids = window_ids(n, seed, epoch, w, window_docs) if k > 1 else np.arange(n)
                units = "truncate" if overflow == "error" else overflow  # as counted above: cut to a unit
                counts[w], last = window_cut(np.asarray(lengths[ids], dtype=np.int64), topology, units)
            if last_micro_batches is not None:
                last_micro_batches[w] = last
        except ValueError as e:
            raise ValueError(f"window {w} of {k} (window_docs = {window_docs}): {e}") from None
    return counts


class _WindowStats:
    """What `step_count` needs of every window's planning units, summed batch by batch from documents' raw lengths
    (a document longer than `cap` is its split pieces with `split`, otherwise cut to `cap`): token totals, pieces
    beyond one per document, units over half of `cap`, tokens per class of the units of at most half of `cap`
    (`class_sums`), and whether all of a window's units have one length (tracked only until every window is known
    to have two)."""

    def __init__(self, k: int, cap: int, split: bool) -> None:
        self.k, self.cap, self.split = k, cap, split
        self.total, self.extra, self.big = (np.zeros(k, dtype=np.int64) for _ in range(3))
        self.common, self.mixed = np.full(k, -1, dtype=np.int64), np.zeros(k, dtype=bool)
        self.small = np.zeros(k * (SMALL_CLASSES + 1), dtype=np.int64)  # per window: the classes, then units over cap/2
        self.all_mixed = False

    def add(self, win: np.ndarray, raw: np.ndarray) -> None:
        if not len(raw):
            return
        k, cap = self.k, self.cap
        win = win.astype(np.intp, copy=False)  # what bincount and take index with, without a conversion each
        over = np.flatnonzero(raw > cap) if int(raw.max()) > cap else None
        tok = raw if over is None else np.minimum(raw, cap)
        self.total += _sums(win, raw if self.split else tok, k)
        self.big += np.bincount(win.take(np.flatnonzero(2 * tok > cap)), minlength=k)
        self._add_small(win, tok)
        if self.split and over is not None:  # full pieces and a rest: one unit was counted, one big unit too
            r, w = raw.take(over), win.take(over)
            rest = r % cap
            self.extra += _sums(w, -(-r // cap) - 1, k)
            self.big += _sums(w, r // cap + (2 * rest > cap) - 1, k)
            self.mixed[w[rest > 0]] = True
            self._add_small(w[rest > 0], rest[rest > 0])
        if not self.all_mixed:
            common = self.common.take(win)
            new = common < 0
            if new.any():  # a window's first units: their length is the one the others are compared with
                self.common[win[new]] = tok[new]
                common = self.common.take(win)
            self.mixed[win[tok != common]] = True
            self.all_mixed = bool(self.mixed.all())

    def _add_small(self, win: np.ndarray, tok: np.ndarray) -> None:
        # `class_of` for units of at most cap/2 tokens, SMALL_CLASSES for larger ones (left out): one bincount
        j = np.clip((tok * (2 * SMALL_CLASSES) - 1) // self.cap, 0, SMALL_CLASSES)
        self.small += _sums(win * (SMALL_CLASSES + 1) + j, tok, len(self.small))

    def window(self, w: int, docs: int) -> tuple[int, int, int, int | None, np.ndarray]:
        """`step_count`'s statistics of window `w`, which holds `docs` documents."""
        common = None if self.mixed[w] else int(self.common[w])
        small = self.small[w * (SMALL_CLASSES + 1) : w * (SMALL_CLASSES + 1) + SMALL_CLASSES]
        return int(self.total[w]), docs + int(self.extra[w]), int(self.big[w]), common, small


def _sums(win: np.ndarray, values: np.ndarray, k: int) -> np.ndarray:
    """Integer `values` summed per window `win`, exact (a chunk's sums stay under 2**53)."""
    return np.rint(np.bincount(win, weights=values, minlength=k)).astype(np.int64)


def plan_steps_bound(lengths: np.ndarray, topology: Topology, cost: CostModel, overflow: str = "error") -> int:
    """An upper bound on the steps of `plan(lengths, topology, cost, overflow=overflow)`, without packing (O(n)).

    The planner cuts an epoch into `len(step_token_targets(...))` steps (`equal_row_steps` when every unit has the
    same length: exact) for a step size it picks among the candidates below, and settling may open one overflow
    step at the end: the bound is the most steps any candidate gives, plus one. The candidates mirror the planner's
    `_choose_step_tokens`: `effective_step_tokens` (one token either side too, so float rounding cannot move a
    boundary) and, when a document may stall its step, also `tokens_per_step` and the top of STEP_BAND (the planner
    then picks one by packing a sample: the bound takes the most steps, up to ~7% over). With dynamic CP: the most
    over every balancing size of `cp_sizes`."""
    lengths = validate_lengths(lengths)
    if topology.dynamic:
        from balancer.planning.dynamic.plan import largest_group_topology

        bounds = []
        for size in topology.group_sizes:
            try:
                bounds.append(plan_steps_bound(lengths, largest_group_topology(topology, size), cost, overflow))
            except ValueError:  # a document this size cannot hold: the planner does not pick it
                continue
        if not bounds:
            raise ValueError(f"no CP size of {topology.cp_sizes} holds every document; overflow={overflow!r}")
        return max(bounds)
    _, u_start, u_end = planning_units(lengths, topology.micro_batch_tokens, overflow, topology)
    u_tok = u_end - u_start
    if u_tok.min() == u_tok.max():  # fixed-length rows: dealt into exactly these steps, no settling
        return len(equal_row_steps(len(u_tok), int(u_tok[0]), topology))
    t, total = topology, int(u_tok.sum())
    tps, cap = t.step_tokens, t.capacity
    u_cost = cost.cost(u_tok)
    shrunk = effective_step_tokens(u_cost, u_tok, t)
    candidates = {shrunk - 1, shrunk, shrunk + 1}
    steps = max(1.0, total / tps)
    share = u_cost.sum() / steps / (t.dp * t.cp) * (1 + (t.pp - 1) / t.micro_batches)
    if shrunk < tps and steps >= 2 and t.pp * u_cost.max() / t.cp > 0.8 * share * (1 - 1e-9):
        candidates |= {tps, min(int(STEP_BAND[1] * tps), int(0.97 * cap))}  # a stall: the planner tries these too
    floor = int(1.25 * t.bins_per_step * u_tok.mean())
    return 1 + max(len(step_token_targets(total, max(1, x), cap, tps, floor)) for x in candidates)


def globalise(local: Plan, ids: np.ndarray, lengths: np.ndarray, window: WindowInfo | None = None) -> Plan:
    """A plan over documents `ids` (local ids 0..len(ids)-1) as a plan with global ids over all of `lengths`."""
    groups = local.group_arrays if local.dynamic else None
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
        window=window,
        last_micro_batches=local.last_micro_batches,
    )
