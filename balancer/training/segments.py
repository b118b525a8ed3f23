"""The plan segments a `BalancedBatchSampler` walks through an epoch: one per window (balancer.planning.window),
the first one possibly the re-planned remainder of a window after an elastic resume.

`EpochWindows` plans a window when it is first needed, keeps at most the two most recent ones (the one a rank is in
and the next, which it plans ahead on a background thread) and remembers every window's step count (one int per
window), so nothing per document is held beyond the current windows. A window's step count is fixed before it is
planned, from its documents and the token budget alone (`window_step_count`; all windows at once in one pass over
the lengths: `window_step_counts`), and the planner fills exactly that many steps: `len(sampler)` is exact and plans
nothing. Only a lone window (the whole-epoch plan) and the re-planned remainder of a window after an elastic resume
are counted by planning them (both are planned before their first micro-batch anyway).

Which model plans window `w` is the epoch's `WindowSchedule` (balancer.planning.schedule: `model(w)` reads it);
`update_model(cost, rank_speeds, first_window)` adds a refitted model to it (balancer.measured's adapt mode) and
drops the plans made for windows from `first_window` on. A window's step count never depends on the model: a window
whose count is known and whose new plan would change it is an error (nothing is silently re-counted).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from balancer.planning.cost.model import CostModel
from balancer.planning.planner import plan as make_plan
from balancer.planning.schedule import WindowSchedule
from balancer.planning.shuffle import num_windows, window_ids
from balancer.planning.topology import Topology
from balancer.planning.window import window_cut, window_seed, window_step_count, window_step_counts
from balancer.training import lengths as training_lengths
from balancer.training.indices import CPGroup

if TYPE_CHECKING:
    from balancer.planning.plans.plan import Plan

KEEP_WINDOWS = 2  # planned windows kept in memory: the current one and the next


@dataclass
class Segment:
    """One plan of (part of) a window: placements (doc, start, end) cut into micro-batches by mb_ptr; with dynamic
    CP also each micro-batch's group (group_start, group_size) and the slot pointer. `plan` is the window's Plan in
    window-local document ids (its costs and times are what the sampler reports)."""

    topology: Topology
    cost: CostModel
    doc: np.ndarray
    start: np.ndarray
    end: np.ndarray
    mb_ptr: np.ndarray
    plan: Any
    group_start: Optional[np.ndarray] = None
    group_size: Optional[np.ndarray] = None
    slot_ptr: Optional[np.ndarray] = None
    ids: Optional[np.ndarray] = None  # the window's global ids (local plan id -> global id); None: identity
    full: Optional[np.ndarray] = None  # each placement's document length, read with the window (a span or whole)
    last_m: Optional[int] = None  # micro-batches (slots) of the last step: M' < M when it is short; None: M
    filler: Optional[np.ndarray] = None  # per placement: a loss-masked filler row (plan(..., filler_rows=True))

    @property
    def group_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Dynamic CP: `(group_start, group_size, slot_ptr)`; ValueError for a segment with fixed CP groups."""
        if self.group_start is None or self.group_size is None or self.slot_ptr is None:
            raise ValueError("this segment has fixed CP groups: group_start, group_size and slot_ptr are dynamic CP's")
        return self.group_start, self.group_size, self.slot_ptr

    @property
    def num_steps(self) -> int:
        t = self.topology
        count = len(self.group_arrays[2]) - 1 if t.dynamic else len(self.mb_ptr) - 1
        return -(-count // (t.micro_batches if t.dynamic else t.bins_per_step))

    def step_micro_batches(self, step: int) -> int:
        """Micro-batches every rank runs in `step`: M, or M' for a short last step."""
        m = self.topology.micro_batches
        return m if self.last_m is None or step < self.num_steps - 1 else self.last_m

    @property
    def total_micro_batches(self) -> int:
        """Micro-batches every rank runs in this segment."""
        n = self.num_steps
        return 0 if n == 0 else (n - 1) * self.topology.micro_batches + self.step_micro_batches(n - 1)

    def first_mb(self, step: int) -> int:
        """Index of the first micro-batch of `step` (`num_steps` gives the end)."""
        if self.topology.dynamic:
            slot_ptr = self.group_arrays[2]
            return int(slot_ptr[min(step * self.topology.micro_batches, len(slot_ptr) - 1)])
        return min(step * self.topology.bins_per_step, len(self.mb_ptr) - 1)

    def mb_index(self, step: int, rank: int, m: int) -> int:
        """The micro-batch of slot `m` of `step` for `rank` (static: the DP rank; dynamic: the pool rank)."""
        t = self.topology
        if not t.dynamic:
            return step * t.bins_per_step + rank * self.step_micro_batches(step) + m
        slot = step * t.micro_batches + m
        group_start, _, slot_ptr = self.group_arrays
        first, last = int(slot_ptr[slot]), int(slot_ptr[slot + 1])
        return first + int(np.searchsorted(group_start[first:last], rank, side="right")) - 1

    def group(self, k: int, rank: int) -> CPGroup:
        """The CP group of micro-batch `k` seen from `rank` (dynamic plans)."""
        group_start, group_size, _ = self.group_arrays
        start = int(group_start[k])
        return CPGroup(start, int(group_size[k]), rank - start)

    def placements(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        a, b = self.mb_ptr[k], self.mb_ptr[k + 1]
        return self.doc[a:b], self.start[a:b], self.end[a:b]

    def piece_sizes(self, k: int, rank: int) -> tuple[np.ndarray, tuple[int, int] | None]:
        """`piece_sizes` of micro-batch `k` of this segment."""
        return piece_sizes(self, k, rank, self.topology.dynamic)

    def step_slice(self, step: int) -> slice:
        return slice(int(self.mb_ptr[self.first_mb(step)]), int(self.mb_ptr[self.first_mb(step + 1)]))

    def consumed_mask(self, steps: int) -> np.ndarray:
        """Placements of the first `steps` steps."""
        n = int(self.mb_ptr[self.first_mb(min(steps, self.num_steps))])
        mask = np.zeros(len(self.doc), dtype=bool)
        mask[:n] = True
        return mask


def plan_units(
    u_doc: Optional[np.ndarray], u_start: Optional[np.ndarray], u_end: Optional[np.ndarray], topology: Topology,
    cost: CostModel, seed: int, overflow: str, lengths: Optional[np.ndarray] = None, fixed: bool = False,
    filler_rows: bool = False,
) -> Segment:  # fmt: skip
    """Plan units (doc, start, end) - each planned as a document of end-start tokens - and map back. `lengths`
    instead: the units are exactly the whole documents of `lengths` (the whole-epoch plan, no remapping). `fixed`:
    into exactly `window_step_count` steps (a window of several)."""
    if lengths is None:
        if u_doc is None or u_start is None or u_end is None:
            raise ValueError("plan_units: give the units (u_doc, u_start, u_end) or the documents' lengths")
        if len(u_doc) == 0:
            e = np.zeros(0, dtype=np.int64)
            groups = (e, e, np.zeros(1, dtype=np.int64)) if topology.dynamic else (None, None, None)
            return Segment(topology, cost, e, e, e, np.zeros(1, dtype=np.int64), None, *groups)
        docs = u_end - u_start
    else:
        docs = lengths
    steps = window_step_count(docs, topology, overflow) if fixed else None
    p = make_plan(docs, topology, cost, seed=seed, overflow=overflow, num_steps=steps, filler_rows=filler_rows)
    if steps is not None and p.num_steps != steps:  # never a silently wrong len(sampler)
        raise RuntimeError(f"the planner made {p.num_steps} steps of a window fixed at {steps}")
    plan_groups = (p.group_start, p.group_size, p.slot_ptr)
    p.natural_step = None  # per document of the window: not needed by the sampler
    last = p.last_micro_batches
    if lengths is not None:
        return Segment(topology, cost, p.doc, p.start, p.end, p.mb_ptr, p, *plan_groups, last_m=last, filler=p.filler)
    assert u_doc is not None and u_start is not None, "the units were checked above (lengths is None)"
    doc, start, end = u_doc[p.doc], u_start[p.doc] + p.start, u_start[p.doc] + p.end
    return Segment(topology, cost, doc, start, end, p.mb_ptr, p, *plan_groups, ids=u_doc, last_m=last, filler=p.filler)


class EpochWindows:
    """An epoch's windows from window `origin` on, as one rank walks them: window `origin` is re-planned after the
    segments in `history` (topology, cost, steps consumed: an elastic resume), every later window is planned for the
    current topology, each with the model `schedule` gives it (default: `topology` and `cost` for every window).
    Thread-safe: the next window may be planned ahead (`plan_ahead`)."""

    def __init__(
        self,
        lengths,
        topology,
        cost,
        *,
        seed: int,
        epoch: int,
        overflow: str,
        window_docs: int,
        origin=0,
        history=(),
        guard=None,
        filler_rows: bool = False,
        schedule: Optional[WindowSchedule] = None,
    ) -> None:
        self.lengths, self.topology, self.cost = lengths, topology, cost
        self.schedule = WindowSchedule(topology, cost) if schedule is None else schedule
        self.seed, self.epoch, self.overflow = seed, epoch, overflow
        self.num_docs = len(lengths)
        self.window_docs = min(int(window_docs), self.num_docs)
        self.count = num_windows(self.num_docs, self.window_docs)
        if not 0 <= origin < self.count:
            raise ValueError(f"window {origin} out of range: this epoch has {self.count} windows")
        self.origin, self.history = int(origin), list(history)
        self.guard = guard  # LengthsGuard: the files behind the lengths checked before each window's read
        self.filler_rows = bool(filler_rows)  # the whole-epoch plan may add loss-masked filler rows
        self._segments: dict[int, Segment] = {}
        self._steps: dict[int, int] = {}  # planned or counted windows' step counts
        self._micro: dict[int, int] = {}  # planned windows' micro-batch counts (a short last step: fewer than M each)
        self._all_counted = False
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._executor: Optional[ThreadPoolExecutor] = None

    def __getstate__(self) -> dict:  # pickles without the thread pool and the plans (re-planned on demand)
        state = dict(self.__dict__)
        state.update(_segments={}, _pending={}, _lock=None, _executor=None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # ---- the model each window is planned with ------------------------------------------------------------
    def model(self, w: int) -> tuple[Topology, CostModel]:
        """(topology, cost model) window `w` is planned with (the schedule's for this epoch)."""
        return self.schedule.model(self.epoch, w)

    def update_model(self, cost: CostModel, rank_speeds: Optional[Sequence[float]], first_window: int) -> None:
        """Plan windows `first_window`.. with `cost` and `rank_speeds` (a tuple for `Topology(rank_speeds=...)`;
        None: the epoch topology's own): `WindowSchedule.update` for this epoch. Those windows' plans already made
        (kept or planned ahead) are dropped and made again on demand; the caller makes sure no micro-batch of them
        has been handed out yet. A window's step count does not depend on the model (`segment` raises if a known
        count would change)."""
        with self._lock:
            change = self.schedule.update(cost, rank_speeds, first_window, epoch=self.epoch)
            first_window = change.window
            for w in [w for w in self._segments if w >= first_window]:
                del self._segments[w]
            for w in [w for w in self._pending if w >= first_window]:
                del self._pending[w]  # a plan under way with the old model: its result is not used

    # ---- planning ---------------------------------------------------------------------------------------------
    def _check(self, w: int) -> None:
        if self.guard is not None:
            self.guard.check(f"window {w} of epoch {self.epoch}")

    def _build(self, w: int) -> Segment:
        seg = self._plan(w)
        self._check(w)  # the lengths did not change while the window was read and planned
        seg.full = np.asarray(self.lengths[seg.doc], dtype=np.int64)
        return seg

    def _plan(self, w: int) -> Segment:
        self._check(w)
        seed = window_seed(self.seed, self.epoch, w, self.count)
        history = self.history if w == self.origin else []
        topology, cost = self.model(w)
        if self.count == 1 and not history:
            return plan_units(
                None, None, None, topology, cost, seed, self.overflow, lengths=self.lengths,
                filler_rows=self.filler_rows,
            )  # fmt: skip
        ids = window_ids(self.num_docs, self.seed, self.epoch, w, self.window_docs)
        u_doc, u_start = ids, np.zeros(len(ids), dtype=np.int64)
        u_end = np.asarray(self.lengths[ids], dtype=np.int64)
        fixed = self.count > 1  # a lone window is the whole-epoch plan: its count is the planner's
        for h in history:
            seg = plan_units(u_doc, u_start, u_end, h["topology"], h["cost"], seed, self.overflow, fixed=fixed)
            if h["steps"] > seg.num_steps:
                raise ValueError(
                    f"the state says {h['steps']} steps of window {w} were consumed but that plan has only "
                    f"{seg.num_steps}"
                )
            left = ~seg.consumed_mask(h["steps"])
            if seg.filler is not None:  # filler rows are no documents: never re-planned as ones
                left &= ~seg.filler
            u_doc, u_start, u_end = seg.doc[left], seg.start[left], seg.end[left]
            order = np.lexsort((u_start, u_doc))
            u_doc, u_start, u_end = u_doc[order], u_start[order], u_end[order]
        return plan_units(
            u_doc, u_start, u_end, topology, cost, seed, self.overflow, fixed=fixed, filler_rows=self.filler_rows
        )

    def segment(self, w: int) -> Segment:
        """The plan segment of window `w` (planned now unless kept or planned ahead)."""
        with self._lock:
            seg = self._segments.get(w)
            pending = self._pending.pop(w, None)
        if seg is not None:
            return seg
        seg = pending.result() if pending is not None else self._build(w)
        if self._steps.get(w, seg.num_steps) != seg.num_steps:
            raise RuntimeError(
                f"window {w} planned with the model {self.model(w)[1]} has {seg.num_steps} steps, {self._steps[w]} "
                "before: a window's step count must not depend on the cost model or the rank speeds"
            )
        if self._micro.get(w, seg.total_micro_batches) != seg.total_micro_batches:
            raise RuntimeError(
                f"window {w} planned has {seg.total_micro_batches} micro-batches per rank, {self._micro[w]} counted"
            )
        with self._lock:
            self._segments[w] = seg
            self._steps[w] = seg.num_steps
            self._micro[w] = seg.total_micro_batches
            for old in sorted(self._segments)[:-KEEP_WINDOWS]:
                if old != w:
                    del self._segments[old]
        return seg

    def plan_ahead(self, w: int) -> None:
        """Start planning window `w` on a background thread (no-op if out of range, kept or already pending)."""
        if not self.origin <= w < self.count:
            return
        with self._lock:
            if w in self._segments or w in self._pending:
                return
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="balancer-window")
            self._pending[w] = self._executor.submit(self._build, w)

    def steps(self, w: int) -> int:
        """Steps of window `w`: its fixed count (`window_step_count`, no planning), or for a lone window or a
        re-planned origin its plan's."""
        if w in self._steps:
            return self._steps[w]
        if self.count == 1 or (w == self.origin and self.history):
            self.segment(w)
        elif w <= self.origin + 1 or self._all_counted:
            ids = window_ids(self.num_docs, self.seed, self.epoch, w, self.window_docs)
            self._check(w)
            try:
                count, last = window_cut(np.asarray(self.lengths[ids], dtype=np.int64), self.topology, self.overflow)
            except ValueError as e:
                raise ValueError(f"window {w} of {self.count} (window_docs = {self.window_docs}): {e}") from None
            self._steps[w] = count
            self._micro[w] = (count - 1) * self.topology.micro_batches + last
        else:
            self.count_all()
        return self._steps[w]

    def count_all(self) -> None:
        """Every window's fixed count in one pass over the lengths (`window_step_counts`), kept (one int each)."""
        if not self._all_counted and self.count > 1:
            self._check(self.origin)
            last = np.zeros(self.count, dtype=np.int64)
            counts = window_step_counts(
                self.lengths, self.topology, seed=self.seed, epoch=self.epoch, window_docs=self.window_docs,
                overflow=self.overflow, chunk=max(1, training_lengths.CHUNK // 8), last_micro_batches=last,
            )  # fmt: skip
            m = self.topology.micro_batches
            for w in range(self.origin, self.count):
                if not (w == self.origin and self.history):
                    self._steps.setdefault(w, int(counts[w]))
                    self._micro.setdefault(w, (int(counts[w]) - 1) * m + int(last[w]))
        self._all_counted = True

    def micro_batches(self, w: int) -> int:
        """Micro-batches every rank runs in window `w`: `steps(w) * micro_batches`, less a short last step's
        missing ones (known once the window is planned; a window counted without planning never has one)."""
        steps = self.steps(w)
        return self._micro.get(w, steps * self.topology.micro_batches)

    def total_micro_batches(self) -> int:
        """Exact micro-batches of windows origin.. (`len(sampler)`)."""
        if self.count - self.origin > 2:
            self.count_all()
        return sum(self.micro_batches(w) for w in range(self.origin, self.count))

    def locate_micro_batch(self, index: int) -> tuple[int, int, int]:
        """(window, micro-batch inside it, steps before it) of the `index`-th micro-batch from the origin."""
        w, first, steps = self.origin, 0, 0
        while w < self.count:
            n = self.micro_batches(w)
            if index < first + n:
                return w, index - first, steps
            first, steps, w = first + n, steps + self.steps(w), w + 1
        return self.count, index - first, steps

    def position_of_step(self, step: int) -> int:
        """Micro-batches from the origin before the `step`-th step from the origin."""
        w, first, position = self.origin, 0, 0
        while w < self.count and step >= first + self.steps(w):
            first, position, w = first + self.steps(w), position + self.micro_batches(w), w + 1
        return position + (step - first) * self.topology.micro_batches

    def total_steps(self) -> int:
        """Exact steps of windows origin.. (plans at most a lone or re-planned origin window)."""
        if self.count - self.origin > 2:
            self.count_all()
        return sum(self.steps(w) for w in range(self.origin, self.count))

    def locate(self, step: int) -> tuple[int, int]:
        """(window, step inside it) of the `step`-th step from the origin; (count, 0) past the end."""
        w, first = self.origin, 0
        while w < self.count:
            n = self.steps(w)
            if step < first + n:
                return w, step - first
            first += n
            w += 1
        return self.count, step - first


def piece_sizes(arrays: Segment | Plan, k: int, rank: int, dynamic: bool) -> tuple[np.ndarray, tuple[int, int] | None]:
    """Token counts of micro-batch `k`'s pieces in `arrays` (a Segment or a Plan: `mb_ptr`, `start`, `end`,
    `group_start`, `group_size`; a filler row copies a whole row: its row's tokens) and, in a dynamic plan, the
    (start, size) of its CP group as `rank` sees it ((rank, 1) when it holds nothing); None in a static plan."""
    a, b = int(arrays.mb_ptr[k]), int(arrays.mb_ptr[k + 1])
    sizes = (arrays.end[a:b] - arrays.start[a:b]).astype(np.int64)
    if not dynamic:
        return sizes, None
    group_start, group_size, _ = arrays.group_arrays
    return sizes, ((int(group_start[k]), int(group_size[k])) if b > a else (rank, 1))
