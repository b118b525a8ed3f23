"""Plan: which documents (or document spans) every micro-batch of every step holds, and on which ranks.

Stored flat: placement arrays `doc`, `start`, `end` (token range of the document; whole documents span
`[0, length)`) in plan order, cut into micro-batches by `mb_ptr`. Inside a micro-batch whole documents come first,
then spans, in the order the model sees them.

- Static CP: micro-batch `k` is step `k // (dp*M)`, replica `(k // M) % dp`, index `k % M`;
  `plan.steps[s].replicas[r].micro_batches[m].docs` is the nested view, `plan.rank_view(dp_rank)` one rank's.
- Dynamic CP (`topology.cp_sizes`): micro-batch `k` runs on the CP group of pool ranks
  `[group_start[k], group_start[k] + group_size[k])`; `slot_ptr` cuts the groups into slots (`M` per step, each
  slot's groups sorted by first rank and covering the pool). `plan.steps[s].slots[k].groups[g]` is the nested
  view, `plan.pool_view(pool_rank)` one rank's.

The file formats are in docs/plan-format.md (reading and writing: balancer.planning.plans.files).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from balancer.planning import metrics as _metrics
from balancer.planning.cost.model import CostModel
from balancer.planning.cost.predict import layout_kind, micro_batch_time, predict_plan
from balancer.planning.plans import layout as layout_record
from balancer.planning.plans.checks import check_last, check_placements, check_shape
from balancer.planning.plans.files import load_plan, plan_to_dict, save_plan
from balancer.planning.shuffle import WindowInfo
from balancer.planning.topology import Topology


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch: whole documents `docs` and partial documents `spans` ([doc, start, end])."""

    docs: list[int]
    spans: list[tuple[int, int, int]] = field(default_factory=list)
    fillers: list[int] = field(default_factory=list)  # loss-masked filler rows: copies of these rows, not documents

    @property
    def ids(self) -> list[int]:
        """Document ids in packing order (whole documents, then the documents of the spans)."""
        return self.docs + [s[0] for s in self.spans]


@dataclass(frozen=True)
class Group(MicroBatch):
    """Dynamic CP: one slot's micro-batch on the pool ranks `ranks = (start, size)`."""

    ranks: tuple[int, int] = (0, 1)

    @property
    def key(self) -> tuple[int, int]:
        """The CP group key `(start, size)` (what `balancer.cp_groups` is keyed by)."""
        return self.ranks


@dataclass(frozen=True)
class Replica:
    micro_batches: list[MicroBatch]


@dataclass(frozen=True)
class Slot:
    """Dynamic CP: one micro-batch slot of a step, the pool cut into `groups`."""

    groups: list[Group]


class Step:
    """One step: `replicas` (static CP) or `slots` (dynamic CP)."""

    def __init__(self, replicas: list[Replica] | None = None, slots: list[Slot] | None = None) -> None:
        self._replicas, self.slots = replicas, slots

    @property
    def replicas(self) -> list[Replica]:
        if self._replicas is None:
            raise AttributeError(_static_view_error("Step.replicas"))
        return self._replicas

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Step) and (self._replicas, self.slots) == (other._replicas, other.slots)

    def __repr__(self) -> str:
        return f"Step(replicas={self._replicas!r})" if self.slots is None else f"Step(slots={self.slots!r})"


def _static_view_error(name: str) -> str:
    return (
        f"{name} is a static-CP view, but this plan has dynamic CP groups (topology.cp_sizes is set): use "
        "plan.steps[s].slots[k].groups or plan.pool_view(pool_rank)"
    )


def _int64_lengths(lengths):
    """`lengths` as int64: in place when they are an int64 array already (a memory map included) or a read-only
    int64 array that gathers without a whole copy (a pretokenized folder's `ShardedArray`: it has `chunks`)."""
    if (
        not isinstance(lengths, np.ndarray)
        and hasattr(lengths, "chunks")
        and getattr(lengths, "dtype", None) == np.int64
    ):
        return lengths
    return np.asarray(lengths, dtype=np.int64)


class Plan:
    """A whole epoch's assignment for one topology; see the module docstring for the layout."""

    def __init__(
        self,
        lengths: np.ndarray,
        topology: Topology,
        cost_model: CostModel,
        doc: np.ndarray,
        start: np.ndarray,
        end: np.ndarray,
        mb_ptr: np.ndarray,
        *,
        seed: int | None = None,
        natural_step: np.ndarray | Callable[[], np.ndarray] | None = None,
        plan_seconds: float = float("nan"),
        dropped_tokens: int | None = None,
        groups: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
        window: WindowInfo | None = None,
        layout: dict | None = None,
        last_micro_batches: int | None = None,
        filler: np.ndarray | None = None,
    ) -> None:
        self.lengths = _int64_lengths(lengths)
        self.topology = topology
        self.cost_model = cost_model
        self.doc = np.asarray(doc, dtype=np.int64)
        self.start = np.asarray(start, dtype=np.int64)
        self.end = np.asarray(end, dtype=np.int64)
        self.mb_ptr = np.asarray(mb_ptr, dtype=np.int64)
        self.seed = seed
        self._natural_step = natural_step  # an array, or how to compute it on first use (`natural_step`)
        self.plan_seconds = plan_seconds
        self.last_micro_batches = check_last(topology, last_micro_batches)
        if topology.dynamic != (groups is not None):
            raise ValueError("a plan has CP groups (group_start, group_size, slot_ptr) exactly when cp_sizes is set")
        self.group_start: np.ndarray | None = None
        self.group_size: np.ndarray | None = None
        self.slot_ptr: np.ndarray | None = None
        if groups is not None:
            self.group_start, self.group_size, self.slot_ptr = (np.asarray(a, dtype=np.int64) for a in groups)
            if len(self.group_start) != len(self.mb_ptr) - 1 or len(self.group_size) != len(self.group_start):
                raise ValueError("a dynamic plan needs one (group_start, group_size) per micro-batch")
            check_shape(len(self.slot_ptr) - 1, topology.micro_batches, self.last_micro_batches, "slots", "M")
        else:
            per, last = topology.bins_per_step, topology.dp * self.last_micro_batches
            check_shape(len(self.mb_ptr) - 1, per, last, "micro-batches", "dp*M")
        self.filler = None if filler is None or not np.any(filler) else np.asarray(filler, dtype=bool)
        if self.filler is not None and len(self.filler) != len(self.doc):
            raise ValueError(f"filler has {len(self.filler)} entries for {len(self.doc)} placements")
        if dropped_tokens is None:
            dropped_tokens = int(self.lengths.sum() - self.real_tokens)
        self.dropped_tokens = dropped_tokens
        self.window = window  # a window plan (balancer.plan_window) places only its window's documents
        self._window_ids: np.ndarray | None = None
        self.layout = layout_record.check_record(self, layout)  # the CP layout record (plans/layout.py)

    # ---- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_micro_batches(
        cls,
        steps: Sequence[Sequence[Sequence[Iterable[int]]]],
        lengths: ArrayLike,
        topology: Topology,
        cost_model: CostModel,
        **kwargs: Any,
    ) -> Plan:
        """Build from nested lists `steps[s][replica][m] -> doc ids` (whole documents only)."""
        flat: list[int] = []
        ptr = [0]
        for s, step in enumerate(steps):
            if len(step) != topology.dp:
                raise ValueError(f"step {s} has {len(step)} replicas, topology has dp={topology.dp}")
            for r, rep in enumerate(step):
                if len(rep) != topology.micro_batches:
                    raise ValueError(
                        f"step {s} replica {r} has {len(rep)} micro-batches, "
                        f"topology has micro_batches={topology.micro_batches}"
                    )
                for mb in rep:
                    flat.extend(int(d) for d in mb)
                    ptr.append(len(flat))
        lengths = np.asarray(lengths, dtype=np.int64)
        doc = np.asarray(flat, dtype=np.int64)
        return cls(lengths, topology, cost_model, doc, np.zeros_like(doc), lengths[doc], np.asarray(ptr), **kwargs)

    @classmethod
    def from_flat_micro_batches(
        cls,
        micro_batches: Sequence[Iterable[int]],
        lengths: ArrayLike,
        topology: Topology,
        cost_model: CostModel,
        **kwargs: Any,
    ) -> Plan:
        """Build from micro-batches in plan order (step-major, then replica, then micro-batch: `dp * micro_batches`
        per step), whole documents only; the form token-count packers produce."""
        per, dp, m = topology.bins_per_step, topology.dp, topology.micro_batches
        if len(micro_batches) % per:
            raise ValueError(f"{len(micro_batches)} micro-batches is not a multiple of dp*micro_batches = {per}")
        steps = [
            [micro_batches[(k * dp + r) * m : (k * dp + r + 1) * m] for r in range(dp)]
            for k in range(len(micro_batches) // per)
        ]
        return cls.from_micro_batches(steps, lengths, topology, cost_model, **kwargs)

    # ---- shape ----------------------------------------------------------------------------------------------
    @property
    def dynamic(self) -> bool:
        return self.topology.dynamic

    @property
    def num_docs(self) -> int:
        return len(self.lengths)

    @property
    def window_ids(self) -> np.ndarray | None:
        """The sorted ids of the documents a window plan places (None: a whole-epoch plan places every document)."""
        if self.window is not None and self._window_ids is None:
            self._window_ids = self.window.ids(self.num_docs)
        return self._window_ids

    @property
    def group_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Dynamic CP: `(group_start, group_size, slot_ptr)`; ValueError for a plan with fixed CP groups."""
        if self.group_start is None or self.group_size is None or self.slot_ptr is None:
            raise ValueError("this plan has fixed CP groups: group_start, group_size and slot_ptr are dynamic CP's")
        return self.group_start, self.group_size, self.slot_ptr

    @property
    def num_steps(self) -> int:
        t, short = self.topology, self.last_micro_batches < self.topology.micro_batches
        if self.dynamic:
            return -(-(len(self.group_arrays[2]) - 1) // t.micro_batches)
        return -(-(len(self.mb_ptr) - 1) // t.bins_per_step) if short else (len(self.mb_ptr) - 1) // t.bins_per_step

    def step_micro_batches(self, s: int) -> int:
        """Micro-batches every replica (dynamic: slots) runs in step `s`: `micro_batches`, or for the last step of
        a plan whose documents cannot fill it `last_micro_batches` (M')."""
        return self.last_micro_batches if s == self.num_steps - 1 else self.topology.micro_batches

    def micro_batch_counts(self) -> np.ndarray:
        """[steps] the micro-batches every replica runs in each step (M, the last maybe M')."""
        counts = np.full(self.num_steps, self.topology.micro_batches, dtype=np.int64)
        if len(counts):
            counts[-1] = self.last_micro_batches
        return counts

    def by_step(self, flat: np.ndarray) -> np.ndarray:
        """Flat per-micro-batch values (plan order) of a static plan as [steps, dp, M], the micro-batches a
        short last step does not run 0."""
        t = self.topology
        out = np.zeros((self.num_steps, t.dp, t.micro_batches), dtype=flat.dtype)
        full = (self.num_steps - 1) * t.bins_per_step if self.num_steps else 0
        if self.last_micro_batches == t.micro_batches:
            return flat.reshape(out.shape)
        out[:-1] = flat[:full].reshape(self.num_steps - 1, t.dp, t.micro_batches)
        out[-1, :, : self.last_micro_batches] = flat[full:].reshape(t.dp, self.last_micro_batches)
        return out

    def __len__(self) -> int:
        return self.num_steps

    @property
    def filler_rows(self) -> int:
        """Loss-masked filler rows the plan holds (`plan(..., filler_rows=True)`): copies of real rows placed so
        that every replica gets a micro-batch in a last step the real rows cannot split equally; 0 without."""
        return 0 if self.filler is None else int(self.filler.sum())

    @property
    def real_tokens(self) -> int:
        """Tokens of the documents placed (filler rows left out)."""
        sizes = self.end - self.start
        return int(sizes.sum() if self.filler is None else sizes[~self.filler].sum())

    def _micro_batch_fields(self, k: int) -> dict[str, list]:
        a, b = self.mb_ptr[k], self.mb_ptr[k + 1]
        doc, start, end = self.doc[a:b], self.start[a:b], self.end[a:b]
        fill = np.zeros(b - a, dtype=bool) if self.filler is None else self.filler[a:b]
        whole = (start == 0) & (end == self.lengths[doc]) & ~fill
        part = ~whole & ~fill
        spans = [(int(d), int(s), int(e)) for d, s, e in zip(doc[part], start[part], end[part])]
        return {"docs": doc[whole].tolist(), "spans": spans, "fillers": doc[fill].tolist()}

    def _micro_batch(self, k: int) -> MicroBatch:
        return MicroBatch(**self._micro_batch_fields(k))

    def _group(self, k: int) -> Group:
        group_start, group_size, _ = self.group_arrays
        return Group(**self._micro_batch_fields(k), ranks=(int(group_start[k]), int(group_size[k])))

    def step(self, s: int) -> Step:
        t = self.topology
        ms = self.step_micro_batches(s)
        if self.dynamic:
            slot_ptr = self.group_arrays[2]
            slots = range(s * t.micro_batches, s * t.micro_batches + ms)
            return Step(
                slots=[Slot([self._group(k) for k in range(slot_ptr[slot], slot_ptr[slot + 1])]) for slot in slots]
            )
        base = s * t.bins_per_step
        return Step([Replica([self._micro_batch(base + r * ms + m) for m in range(ms)]) for r in range(t.dp)])

    @property
    def steps(self) -> list[Step]:
        """Nested view: `steps[s].replicas[r].micro_batches[m].docs` (dynamic: `steps[s].slots[k].groups[g]`)."""
        return [self.step(s) for s in range(self.num_steps)]

    def rank_view(self, dp_rank: int) -> list[list[list[int]]]:
        """This DP rank's micro-batches: `[step][m] -> document ids` in packing order."""
        t = self.topology
        if self.dynamic:
            raise ValueError(_static_view_error("Plan.rank_view"))
        if not 0 <= dp_rank < t.dp:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp={t.dp}")
        out = []
        for s in range(self.num_steps):
            ms = self.step_micro_batches(s)
            base = s * t.bins_per_step + dp_rank * ms
            out.append([self._documents(k) for k in range(base, base + ms)])
        return out

    def _documents(self, k: int) -> list[int]:
        """Document ids of micro-batch `k` in packing order, filler rows left out."""
        a, b = self.mb_ptr[k], self.mb_ptr[k + 1]
        return (self.doc[a:b] if self.filler is None else self.doc[a:b][~self.filler[a:b]]).tolist()

    def rank_groups(self, pool_rank: int) -> np.ndarray:
        """Dynamic CP: [steps * M] index of the micro-batch (group) holding `pool_rank` in every slot."""
        if not 0 <= pool_rank < self.topology.pool_size:
            raise ValueError(f"pool rank {pool_rank} out of range for a pool of dp*cp = {self.topology.pool_size}")
        group_start, group_size, _ = self.group_arrays
        inside = (group_start <= pool_rank) & (pool_rank < group_start + group_size)
        return np.flatnonzero(inside)

    def pool_view(self, pool_rank: int) -> list[list[tuple[tuple[int, int], list[int]]]]:
        """Dynamic CP: `[step][slot] -> ((start, size), document ids)` of the group holding `pool_rank`
        (pool rank = dp_rank * cp + cp_rank)."""
        if not self.dynamic:
            raise ValueError("Plan.pool_view is the dynamic-CP view; this plan has fixed CP groups (use rank_view)")
        m = self.topology.micro_batches
        group_start, group_size, _ = self.group_arrays
        out: list = []
        for slot, k in enumerate(self.rank_groups(pool_rank)):
            if slot % m == 0:
                out.append([])
            key = (int(group_start[k]), int(group_size[k]))
            out[-1].append((key, self.doc[self.mb_ptr[k] : self.mb_ptr[k + 1]].tolist()))
        return out

    # ---- costs and metrics ----------------------------------------------------------------------------------
    @cached_property
    def _entry_cost(self) -> np.ndarray:
        return self.cost_model.cost(self.end - self.start)

    def _mb_cost_flat(self) -> np.ndarray:
        ptr = self.mb_ptr
        sums = np.add.reduceat(np.append(self._entry_cost, 0.0), ptr[:-1]) if len(ptr) > 1 else np.zeros(0)
        return np.where(np.diff(ptr) > 0, sums, 0.0) + self.cost_model.fixed

    def micro_batch_costs(self) -> np.ndarray:
        """[steps, dp, M] cost of each micro-batch (fixed included), before dividing by cp (a short last step's
        missing micro-batches: 0); dynamic plans: the flat [micro-batches] cost of every group's micro-batch."""
        if self.dynamic:
            return self._mb_cost_flat()
        return self.by_step(self._mb_cost_flat())

    def flat_micro_batch_tokens(self) -> np.ndarray:
        """[micro-batches] tokens of each micro-batch in plan order."""
        return np.diff(np.concatenate([[0], np.cumsum(self.end - self.start)])[self.mb_ptr])

    def micro_batch_tokens(self) -> np.ndarray:
        """[steps, dp, M] tokens of each micro-batch (a short last step's missing micro-batches: 0; dynamic plans:
        flat [micro-batches])."""
        tok = self.flat_micro_batch_tokens()
        return tok if self.dynamic else self.by_step(tok)

    def step_of_micro_batch(self) -> np.ndarray:
        """[micro-batches] the step of each micro-batch."""
        if self.dynamic:
            slot_ptr = self.group_arrays[2]
            slot = np.repeat(np.arange(len(slot_ptr) - 1), np.diff(slot_ptr))
            return slot // self.topology.micro_batches
        return np.minimum(np.arange(len(self.mb_ptr) - 1) // self.topology.bins_per_step, self.num_steps - 1)

    def step_of_entry(self) -> np.ndarray:
        return np.repeat(self.step_of_micro_batch(), np.diff(self.mb_ptr))

    def step_times(self) -> np.ndarray:
        """[steps] the modelled time of every step (per-rank cost units)."""
        if self.dynamic:
            return _metrics.dynamic_step_times(self._mb_cost_flat(), *self.group_arrays, self.topology)
        return _metrics.step_times(self.micro_batch_costs(), self.topology)

    @property
    def natural_step(self) -> np.ndarray | None:
        """Step each document would land in if the shuffled order were cut every `tokens_per_step` tokens (int64,
        indexed by document id; None when unknown). A planner may pass how to compute it: it is computed on first
        use, as only `mean_delay_steps` and saved plans read it."""
        if callable(self._natural_step):
            self._natural_step = self._natural_step()
        if self._natural_step is not None:
            self._natural_step = np.asarray(self._natural_step, dtype=np.int64)
        return self._natural_step

    @natural_step.setter
    def natural_step(self, value: np.ndarray | None) -> None:
        self._natural_step = value

    def metrics(self) -> dict:
        """The balance metrics of docs/design.md (see balancer.planning.metrics for the definitions)."""
        step_of = self.step_of_entry()
        cost = self._entry_cost
        work = np.bincount(step_of, weights=cost, minlength=self.num_steps)
        largest = np.zeros(self.num_steps)
        np.maximum.at(largest, step_of, cost)
        delay = None
        if self.natural_step is not None:
            delay = np.abs(step_of - self.natural_step[self.doc])
        return _metrics.summarize(
            self.step_times(),
            work,
            largest,
            self.topology,
            self.cost_model,
            total_tokens=self.real_tokens,
            padding_tokens=int((self.end - self.start).sum()) - self.real_tokens,  # filler rows
            dropped_tokens=self.dropped_tokens,
            delay_steps=delay,
            plan_seconds=self.plan_seconds,
            micro_batches=self.micro_batch_counts(),
        )

    def with_layout(self, spec: dict) -> Plan:
        """This plan with a CP layout record (`{"kind": ..., options}`); a cost-driven hybrid spec (`cost`,
        `method`) is recorded as the explicit split set of every micro-batch. The placements are shared."""
        plan = copy.copy(self)
        plan.layout = layout_record.with_explicit_splits(self, spec)
        return plan

    def micro_batch_layout(self, k: int) -> dict:
        """The explicit layout spec of flat micro-batch `k` (`attention.CPLayout.from_spec(cu_seqlens, cp, spec)`
        with the micro-batch's placements in order re-derives every rank's share)."""
        return layout_record.micro_batch_layout(self, k)

    def predict(
        self, cost: CostModel | None = None, layout: str | dict = "zigzag", method: str = "ring", **layout_options: Any
    ) -> dict:
        """Layout- and communication-aware time report (`predict_plan`; docs/cost-model.md);
        `metrics()` keeps the compute-only definitions. Dynamic plans: every group's micro-batch is timed on its own
        group size and the steps assembled with the slot model (`micro_batch_times` is then flat, one per group)."""
        if not self.dynamic:
            return predict_plan(self, cost, layout, method, **layout_options)
        cost = self.cost_model if cost is None else cost
        layout, layout_options = layout_kind(layout, layout_options)
        group_start, group_size, slot_ptr = self.group_arrays
        sizes = self.end - self.start
        ptr = self.mb_ptr
        times = np.array(
            [
                micro_batch_time(cost, sizes[ptr[k] : ptr[k + 1]], int(group_size[k]), layout, method, **layout_options)
                for k in range(len(ptr) - 1)
            ]
        )
        step = _metrics.dynamic_step_times(times * group_size, group_start, group_size, slot_ptr, self.topology)
        return {
            "layout": {"kind": layout, **layout_options},
            "method": method,
            "micro_batch_times": times,
            "step_times": step,
            "step_time_total": float(step.sum()),
            "compute_only_total": float(self.step_times().sum()),
        }

    def validate(self) -> None:
        """Check the plan's invariants; raise ValueError naming the first violation.

        Every token of every document is placed exactly once: its spans start at 0, follow each other without gap or
        overlap and end at its length (truncated documents: at the one truncation cut, the tokens left out adding
        up to `dropped_tokens`); every micro-batch is non-empty and within its token cap (`max_tokens * cp`,
        dynamic: `max_tokens * size`); with dynamic CP every slot's groups are aligned (`start % size == 0`), of
        sizes in `cp_sizes`, and cover the pool exactly. Errors name the step, replica / slot, micro-batch and
        document (balancer.planning.plans.checks).
        """
        check_placements(self)

    # ---- I/O ------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return plan_to_dict(self)

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically: `.npz` (compact flat arrays) or anything else as JSON (docs/plan-format.md)."""
        save_plan(self, path)

    @classmethod
    def load(cls, path: str | os.PathLike, lengths: np.ndarray | None = None, validate: bool = True) -> Plan:
        """Read a plan written by `save` (JSON or .npz). `lengths` is needed only if the file has none; when both
        exist they must agree. Every field is checked (types, ranges, pointer arrays) and, with `validate=True`
        (default), the plan's invariants too (`Plan.validate`): a bad file raises one ValueError naming the file
        and the field. `validate=False` skips only the invariant check (linear in the plan's size), for speed on
        files you wrote yourself."""
        return load_plan(cls, path, lengths, validate)
