"""BalancedBatchSampler: this DP rank's micro-batches of a balanced epoch plan, as a torch batch sampler.

Every rank plans the same epoch, window by window (balancer.planning.window: a window is a contiguous block of
`window_docs` documents of the epoch's seeded shuffle, planned from (seed, epoch, window index) alone:
deterministic, no communication), and yields its own view: exactly `micro_batches` micro-batches per step, the same
number on every rank, every document once per epoch over all ranks. With one window (`window_docs >=
len(lengths)`) the plan is `balancer.plan(lengths, topology, cost, seed=seed + epoch)`, the whole-epoch plan. A
window's last step may hold fewer tokens than `tokens_per_step` (the one exception to the step-size rule besides
the epoch's last step). Only the window a rank is in is held (and the next, planned ahead on a background thread
from the middle of the current one); lengths may be a memory-mapped array and are never copied whole.

    sampler = BalancedBatchSampler(lengths, topo, cost, dp_rank=r, seed=0)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=PackedCollator(cp_rank=c, cp_size=topo.cp))
    for epoch in range(E):
        sampler.set_epoch(epoch)
        for batch in loader: ...

Yielded indices are Python ints. With `overflow="split"` or `"truncate"`, a part of a document is yielded as a
:class:`Span` (doc, start, end); wrap the dataset in :class:`SpanDataset` so it returns that token range (a plain
dataset refuses a Span with an error instead of silently returning the whole document).

Resume contract (`state_dict` / `load_state_dict`, also the torchdata StatefulDataLoader protocol: the iterator
returned by `iter(sampler)` has `state_dict`/`load_state_dict` too):
  - the state holds the epoch, the window size and the window the rank is in, `position` (micro-batches of that
    window's plan this rank has yielded), the seed, the overflow policy, a fingerprint of the lengths, and the
    chain of plan *segments* of that window (topology, cost model, steps consumed) - a few hundred bytes, no
    document lists: the consumed documents are re-derived by re-planning deterministically;
  - same topology and cost model: resume at any micro-batch; the remainder is identical to an uninterrupted run;
  - a different topology (DP size, CP size, micro_batches, max_tokens, ...) or cost model: the state must sit at a
    step boundary (`position % micro_batches == 0`, what every rank has after a finished optimizer step); the
    documents (or, for split documents, the token windows) of the window not yet consumed are re-planned for the
    new topology, later windows are planned for it: nothing lost, nothing repeated. A mid-step state onto a new
    topology is refused;
  - the resumed epoch keeps the state's window size (the windows are part of the epoch's identity); later epochs
    use the sampler's own;
  - a state from another seed, data set (lengths) or overflow policy is refused with a ValueError.

After a resume, positions count from the start of the resumed window's (re-planned) plan: `position`,
`len(sampler)` and `num_steps` cover the rest of the epoch from there.

`len(sampler)` is exact, the same on every rank, and with several windows plans nothing: each window's step count is
fixed from its documents and the token budget (`window_step_counts`: one pass over the lengths), docs/windows.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import numpy as np
import torch

from balancer.limits import check_indices
from balancer.planning.cost.model import CostModel
from balancer.planning.plans.plan import Plan
from balancer.planning.schedule import StepPlace, WindowSchedule, check_seed, resume_chain
from balancer.planning.schedule import plan_start as wrap_plan_start
from balancer.planning.shuffle import num_windows
from balancer.planning.topology import Topology
from balancer.planning.units import OVERFLOW_POLICIES, check_topology_and_cost
from balancer.planning.window import check_window_docs, default_window_docs
from balancer.training.indices import CPGroup, Filler, Member, Span, SpanDataset
from balancer.training.lengths import LengthsGuard, resolve_lengths, scan_lengths
from balancer.training.ranks import resolve_pool_rank
from balancer.training.sampler_state import STATE_FORMAT, STATE_VERSION, check_state, state_digest
from balancer.training.segments import EpochWindows, Segment
from balancer.training.step_info import StepInfo, predicted_step, step_info

UP_FRONT_COUNT = 1 << 22  # up to this many documents an explicit window_docs is checked on every window up front

__all__ = ["BalancedBatchSampler", "Span", "SpanDataset", "Member", "CPGroup", "resolve_lengths", "STATE_FORMAT"]


class BalancedBatchSampler(torch.utils.data.Sampler):
    """Yields this rank's micro-batches (lists of dataset indices) of the balanced plan of each epoch.

    Args:
        lengths: token count per dataset item: an array/list (a memory-mapped array is used in place), a
            pretokenized folder (or `.npy` - memory-mapped - or `.json` lengths file) path, a `ShardDataset`, a
            `datasets.Dataset` (lengths of its `input_ids` rows), or the name of a column of `dataset` (an int column
            of lengths, or a list column such as `input_ids`).
        topology, cost: the `Topology` and `CostModel` of the run.
        dp_rank: this rank's data-parallel index. When None: from `device_mesh` (its `dp_dim` dimension) or, when
            torch.distributed is initialised, `rank // (cp * pp)` of the default group (DP outermost; the world size
            must equal `topology.world_size`); otherwise 0 when `topology.dp == 1`.
        seed: the epoch's shuffle and plans come from (seed, epoch) (one window: `balancer.plan(...,
            seed=seed + epoch)`).
        overflow: the planner's policy for documents over `max_tokens * cp` ("error", "split", "truncate").
        dataset: the dataset the indices go to (checked to have `len(lengths)` items).
        rank: this rank's pool rank `dp_rank * cp + cp_rank` (instead of `dp_rank`). Required for dynamic CP
            (`topology.cp_sizes`) unless torch.distributed is initialised (then `global rank // pp`). With dynamic
            CP every whole document comes as a :class:`Member` (an int) and every part as a :class:`Span`, both
            carrying the micro-batch's :class:`CPGroup`; wrap the dataset in `SpanDataset` so the items carry it
            to `PackedCollator`.
        window_docs: documents per planning window (at least dp * micro_batches); None: the default, the documents
            of about 64 steps and at least 65,536 (docs/windows.md); `>= len(lengths)`: the whole epoch as one window.
        filler_rows: `balancer.plan(..., filler_rows=True)` (whole-epoch plans): its loss-masked filler rows come as
            :class:`Filler` indices; wrap the dataset in `SpanDataset` so `PackedCollator` masks them.
    """

    def __init__(
        self,
        lengths,
        topology: Topology,
        cost: CostModel,
        dp_rank: Optional[int] = None,
        seed: int = 0,
        overflow: str = "error",
        dataset=None,
        device_mesh=None,
        dp_dim: str = "dp",
        rank: Optional[int] = None,
        window_docs: Optional[int] = None,
        filler_rows: bool = False,
    ) -> None:
        check_topology_and_cost(topology, cost)
        if overflow not in OVERFLOW_POLICIES:
            raise ValueError(f"overflow must be one of {OVERFLOW_POLICIES}, got {overflow!r}")
        seed = check_seed(seed)
        self.lengths, _ = resolve_lengths(lengths, dataset)
        summary = scan_lengths(self.lengths)
        n = summary.num_docs
        if window_docs is None:
            self.window_docs = default_window_docs(n, summary.total_tokens, topology)
        else:
            if isinstance(window_docs, bool) or not isinstance(window_docs, (int, np.integer)):
                raise TypeError(f"window_docs must be an integer or None, got {window_docs!r}")
            self.window_docs = n if window_docs >= n else check_window_docs(window_docs, topology, n)
        self._check_fits(summary, topology, overflow)
        self.topology = topology
        self.cost = cost
        self.seed = seed
        self.overflow = overflow
        self.pool_rank = resolve_pool_rank(rank, dp_rank, topology, device_mesh, dp_dim)
        self.dp_rank = self.pool_rank // topology.cp
        self.fingerprint = summary.fingerprint
        self._guard = LengthsGuard(self.lengths, summary.fingerprint)
        self.epoch = 0
        self.position = 0  # micro-batches this rank has yielded since the start of window `origin`'s plan
        self._windows: Optional[EpochWindows] = None
        self._epoch_setup: tuple[int, int, list] = (
            self.window_docs,
            0,
            [],
        )  # (window_docs, origin window, history) of this epoch
        self._cursor = (0, 0)  # (window, position at its first micro-batch) of the last yielded micro-batch
        self._resume_pending = False
        self._passes, self._stale = 0, ""  # passes ended by set_epoch (an iterator of an older one refuses to go on)
        self.monitor = None  # a balancer.BalanceMonitor attaches itself here (StepSource: balancer.measured.source)
        self.schedule = WindowSchedule(topology, cost)  # which model plans each window of each epoch
        self.filler_rows = bool(filler_rows)
        if window_docs is not None and self.window_docs < n and n <= UP_FRONT_COUNT:
            self.windows.count_all()  # a size some window of this epoch cannot fill is refused here, naming it

    def _check_fits(self, summary, topology: Topology, overflow: str) -> None:
        if topology.dynamic:
            from balancer.planning.dynamic.plan import check_fits

            try:  # checked on the longest document alone: the lengths are not read again
                check_fits(np.array([summary.longest]), topology, overflow)
            except ValueError as e:
                raise ValueError(str(e).replace("document 0 ", f"document {summary.longest_doc} ", 1)) from None
        elif overflow == "error" and summary.longest > topology.micro_batch_tokens:
            raise ValueError(
                f"document {summary.longest_doc} has {summary.longest} tokens, more than a micro-batch holds: "
                f"max_tokens*cp = {topology.max_tokens}*{topology.cp} = {topology.micro_batch_tokens}; raise "
                "max_tokens or cp, or pass overflow='split' or 'truncate'"
            )

    # ---- plan -------------------------------------------------------------------------------------------------
    @property
    def windows(self) -> EpochWindows:
        """This epoch's windows (from the resumed one on, after a resume)."""
        if self._windows is None:
            window_docs, origin, history = self._epoch_setup
            self._windows = EpochWindows(
                self.lengths, self.topology, self.cost, seed=self.seed, epoch=self.epoch,
                overflow=self.overflow, window_docs=window_docs, origin=origin, history=history, guard=self._guard,
                filler_rows=self.filler_rows, schedule=self.schedule,
            )  # fmt: skip
        return self._windows

    @property
    def num_windows(self) -> int:
        return self.windows.count

    @property
    def segment(self) -> Segment:
        """The plan segment of the window this rank is in."""
        return self.windows.segment(self._cursor[0])

    @property
    def plan(self) -> Optional[Plan]:
        """The `balancer.Plan` of the window this rank is in (the last one once the epoch is done; None if nothing is
        left), document ids global. With several windows it places only that window's documents (`plan_window`)."""
        seg = self.windows.segment(min(self._cursor[0], self.windows.count - 1))
        if seg.plan is None or seg.ids is None:
            return seg.plan
        groups = seg.group_arrays if self.topology.dynamic else None
        p = seg.plan
        return Plan(self.lengths, seg.topology, seg.cost, seg.doc, seg.start, seg.end, seg.mb_ptr, seed=p.seed,
                    plan_seconds=p.plan_seconds, dropped_tokens=p.dropped_tokens, groups=groups,
                    last_micro_batches=seg.last_m)  # fmt: skip

    @property
    def num_steps(self) -> int:
        """Exact optimizer steps from the origin to the end of the epoch (plans no window but a lone one)."""
        return self.windows.total_steps()

    def __len__(self) -> int:
        """Micro-batches this rank yields from the origin to the end of the epoch: exact (module docstring)."""
        return self.windows.total_micro_batches()

    def step_micro_batches(self, step: int) -> int:
        """Micro-batches every rank runs in `step`: `micro_batches`, or M' in a short last step (docs/training.md)."""
        seg, local = self._locate(step)
        return seg.step_micro_batches(local)

    def position_of_step(self, step: int) -> int:
        """Micro-batches from the origin before `step` (`num_steps` gives `len(sampler)`)."""
        return self.windows.position_of_step(step)

    def epoch_num_steps(self, epoch: int) -> int:
        """Optimizer steps of a fresh pass over `epoch` (this sampler's topology and window size), as `num_steps`."""
        if epoch == self.epoch and self._epoch_setup[1:] == (0, []) and self._epoch_setup[0] == self.window_docs:
            return self.num_steps
        return EpochWindows(
            self.lengths, self.topology, self.cost, seed=self.seed, epoch=int(epoch), overflow=self.overflow,
            window_docs=self.window_docs, guard=self._guard, filler_rows=self.filler_rows,
        ).total_steps()  # fmt: skip

    def _locate(self, step: int) -> tuple[Segment, int]:
        """The segment and the step inside it of the `step`-th step from the origin."""
        w, local = self.windows.locate(int(step))
        if step < 0 or w >= self.windows.count:
            raise IndexError(f"step {step} out of range: this plan has {self.num_steps} steps")
        return self.windows.segment(w), local

    def micro_batch(self, step: int, m: int, dp_rank: Optional[int] = None, rank: Optional[int] = None) -> list:
        """Indices of micro-batch (slot) `m` of `step` for `dp_rank` or pool `rank` (default: this rank)."""
        seg, local, m, dp_rank, rank = self._slot(step, m, dp_rank, rank)
        return self._indices(seg, local, m, dp_rank, rank)

    def piece_sizes(self, step: int, m: int, dp_rank: Optional[int] = None, rank: Optional[int] = None) -> tuple:
        """(token counts of the pieces `micro_batch` gives, the (start, size) of a dynamic plan's CP group or
        None), read from the plan's arrays without building the indices (the monitor reads every rank's)."""
        seg, local, m, dp_rank, rank = self._slot(step, m, dp_rank, rank)
        t = self.topology
        unit = (self.pool_rank if rank is None else rank) if t.dynamic else self._dp_of(dp_rank, rank)
        return seg.piece_sizes(seg.mb_index(local, unit, m), unit)

    def _slot(self, step: int, m: int, dp_rank, rank) -> tuple:
        """(segment, step inside it, m, dp_rank, rank) of slot `m` of `step`, the arguments checked."""
        t = self.topology
        step, m, dp_rank, rank = check_indices(step, m, dp_rank, rank, sizes=(None, t.micro_batches, t.dp, t.pool_size))
        seg, local = self._locate(step)
        if m >= seg.step_micro_batches(local):
            raise IndexError(f"m={m} out of range: step {step} is a short last step of {seg.step_micro_batches(local)}")
        return seg, local, m, dp_rank, rank

    def _dp_of(self, dp_rank, rank) -> int:
        """The DP rank of a static plan's `dp_rank` / pool `rank` argument (default: this rank's)."""
        if rank is not None:
            return rank // self.topology.cp
        return self.dp_rank if dp_rank is None else dp_rank

    def _indices(self, seg: Segment, step: int, m: int, dp_rank=None, rank=None) -> list:
        assert seg.full is not None, "EpochWindows._build sets each placement's document length"
        if not self.topology.dynamic:
            k = seg.mb_index(step, self._dp_of(dp_rank, rank), m)
            doc, start, end = seg.placements(k)
            full = seg.full[seg.mb_ptr[k] : seg.mb_ptr[k + 1]]
            out: list = [int(d) if (s == 0 and e == f) else Span(d, s, e) for d, s, e, f in zip(doc, start, end, full)]
            if seg.filler is not None:  # loss-masked filler rows (filler_rows=True): last in the micro-batch
                fill = seg.filler[seg.mb_ptr[k] : seg.mb_ptr[k + 1]]
                out = [Filler(int(d)) if f else x for x, d, f in zip(out, doc, fill)]
            return out
        rank = self.pool_rank if rank is None else rank
        k = seg.mb_index(step, rank, m)
        group = seg.group(k, rank)
        doc, start, end = seg.placements(k)
        full = seg.full[seg.mb_ptr[k] : seg.mb_ptr[k + 1]]
        return [
            Member(d, group) if (s == 0 and e == f) else Span(d, s, e, group)
            for d, s, e, f in zip(doc, start, end, full)
        ]

    def cp_group(self, step: int, m: int) -> CPGroup:
        """The CP group this rank runs micro-batch (slot) `m` of `step` on (static plans: its replica's)."""
        t = self.topology
        if not t.dynamic:
            return CPGroup(self.dp_rank * t.cp, t.cp, self.pool_rank - self.dp_rank * t.cp)
        seg, local = self._locate(step)
        return seg.group(seg.mb_index(local, self.pool_rank, m), self.pool_rank)

    def step_of(self, index: int) -> tuple[int, int]:
        """(step, m) of the `index`-th micro-batch this rank yields from the origin."""
        _, local, steps = self.windows.locate_micro_batch(int(index))
        step, m = divmod(local, self.topology.micro_batches)
        return steps + step, m

    # ---- per-step information -----------------------------------------------------------------------------------
    def step_info(self, step: int) -> StepInfo:
        """Everything about `step` in one object (`StepInfo`); the accessors below give its figures one by one."""
        return step_info(self, step)

    def step_sizes(self, step: int) -> np.ndarray:
        """Token counts of `step`'s documents (filler rows left out)."""
        seg, local = self._locate(step)
        sl = seg.step_slice(local)
        sizes = seg.end[sl] - seg.start[sl]
        return sizes if seg.filler is None else sizes[~seg.filler[sl]]

    def step_loss_tokens(self, step: int) -> int:
        """Global number of loss tokens of `step` (all DP ranks, all micro-batches): sum over its documents (or
        document windows) of `tokens - 1`, each document's last token having no target. Pass it to
        `balancer.loss.token_loss` as the normaliser (valid when every token is a training target; with masked
        labels, sum the collator's `num_loss_tokens` over the step instead)."""
        return int((self.step_sizes(step) - 1).sum())

    def step_tokens(self, step: int) -> int:
        return int(self.step_sizes(step).sum())

    def step_num_sequences(self, step: int) -> int:
        """Documents (or windows) of `step` holding at least one loss token: the normaliser of the per-sequence
        loss (`balancer.loss.token_loss(..., reduction="sequence")`)."""
        return int((self.step_sizes(step) > 1).sum())

    def predicted_times(self, step: int) -> np.ndarray:
        """[dp, M] predicted time (cost-model units) of every micro-batch of `step` on one CP rank: cost / cp
        ([dp, M'] for a short last step). Dynamic CP: [M] the time of this rank's group in every slot, cost / size."""
        seg, local = self._locate(step)
        if seg.plan is None:
            raise IndexError("nothing left to plan in this epoch")
        ms = seg.step_micro_batches(local)
        if self.topology.dynamic:
            ks = [seg.mb_index(local, self.pool_rank, m) for m in range(ms)]
            return seg.plan.micro_batch_costs()[ks] / seg.group_arrays[1][ks]
        return seg.plan.micro_batch_costs()[local][:, :ms] / self.topology.cp

    def predicted_step(self, step: int) -> dict:
        """Telemetry of `step`: predicted per-replica 1F1B times (`replica_times`, [dp]), the step time (max), the
        step's lower bound (docs/design.md) and their ratio (`imbalance`), loss tokens and tokens."""
        return predicted_step(self, step)

    # ---- iteration ------------------------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (its plan uses seed + epoch). Setting the epoch a loaded state is in keeps the resume
        position; any other epoch starts from its beginning, and an iterator of the old pass raises on its next
        micro-batch (it would go on with the new epoch's plan: the old pass's rest lost, unnoticed)."""
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative integer, got {type(epoch).__name__} {epoch!r}")
        epoch = int(epoch)
        if epoch == self.epoch:
            return
        self._stale = f"set_epoch({epoch}) was called while this pass (epoch {self.epoch}) was read"
        self._passes += 1
        self.epoch = epoch
        self._restart()

    def _restart(self) -> None:
        """A fresh pass over the current epoch with this sampler's own window size and topology."""
        stale = self._windows is not None and self._windows.epoch != self.epoch
        if stale or self._epoch_setup != (self.window_docs, 0, []):
            self._windows = None
        self._epoch_setup = (self.window_docs, 0, [])
        self.position, self._cursor = 0, (0, 0)
        self._resume_pending = False

    def __iter__(self) -> _SamplerIter:
        if self._resume_pending:
            self._resume_pending = False
        else:
            self._restart()
        return _SamplerIter(self)

    def _next_indices(self) -> list:
        """The next micro-batch of this rank (StopIteration at the end of the epoch); plans windows as it goes."""
        ew = self.windows
        m_per_step = self.topology.micro_batches
        while True:
            w, first = self._cursor
            if w >= ew.count:
                raise StopIteration
            n = ew.micro_batches(w)
            local = self.position - first
            if local < n:
                break
            self._cursor = (w + 1, first + n)
        if 2 * local >= n:
            ew.plan_ahead(w + 1)
        step, m = divmod(local, m_per_step)
        out = self._indices(ew.segment(w), step, m)
        self.position += 1
        return out

    # ---- what BalanceMonitor reads (balancer.measured.StepSource) ---------------------------------------------------
    def step_place(self, step: int) -> StepPlace:
        """(window, last step of it?, micro-batches every rank runs in it) of the `step`-th step from the origin."""
        w, local = self.windows.locate(int(step))
        if step < 0 or w >= self.windows.count:
            raise IndexError(f"step {step} out of range: this plan has {self.num_steps} steps")
        return StepPlace(w, local == self.windows.steps(w) - 1, self.windows.segment(w).step_micro_batches(local))

    def plan_start(self, epoch: int, window: int) -> tuple[int, int]:
        """The (epoch, window) a model for window `window` of `epoch` plans from: past the epoch's last window it
        wraps into the next epochs (this sampler's window size); a model for an epoch this sampler has left plans
        from the next one (the current epoch's windows may already be planned, differently on different ranks):
        `balancer.planning.schedule.plan_start`."""
        return wrap_plan_start(
            epoch, window, current_epoch=self.epoch, current_windows=self.windows.count,
            epoch_windows=num_windows(len(self.lengths), self.window_docs),
        )  # fmt: skip

    def update_model(
        self, cost: CostModel, rank_speeds: Optional[Sequence[float]], first_window: int, *, epoch: int
    ) -> None:
        """Plan the windows from (`epoch`, `first_window`) on with `cost` and `rank_speeds` (adapt mode's refit); a
        window of the current epoch that this rank already started is a RuntimeError (the sampler is ahead of the
        training loop by more than a window)."""
        ew = self._windows
        current = ew is not None and ew.epoch == epoch == self.epoch
        if current and self.position > 0 and self._cursor[0] >= first_window:
            raise RuntimeError(
                f"BalanceMonitor: the refit for window {first_window} arrived after the sampler started it (it is "
                "ahead of the training loop by more than a window): use larger windows or less prefetching"
            )
        if current and ew is not None:
            ew.update_model(cost, rank_speeds, first_window)
        else:
            self.schedule.update(cost, rank_speeds, first_window, epoch=epoch)

    # ---- state ------------------------------------------------------------------------------------------------
    def state_dict(self, position: Optional[int] = None) -> dict:
        """The resume state. `position` overrides the micro-batches counted as consumed (default: those handed
        out; with DataLoader workers prefetching, pass the number your loop consumed since the origin)."""
        if position is None:
            position = self.position
        elif isinstance(position, bool) or not isinstance(position, (int, np.integer)) or position < 0:
            raise ValueError(f"position must be a non-negative integer, got {position!r}")
        ew = self.windows
        w, first = ew.origin, 0
        while True:
            n = ew.micro_batches(w)
            if position - first < n or w == ew.count - 1:
                break
            w, first = w + 1, first + n
        if position - first > n:
            raise ValueError(f"position {position} out of range 0..{first + n}")
        topology, cost = ew.model(w)
        here = [{"topology": topology.to_dict(), "cost": cost.to_dict(), "steps": None}]
        past = ew.history if w == ew.origin else []
        extra: dict[str, dict] = {} if self.monitor is None else {"monitor": self.monitor.state_dict()}
        state = {
            "format": STATE_FORMAT,
            "format_version": STATE_VERSION,
            "epoch": self.epoch,
            "window_docs": ew.window_docs,
            "window": w,
            "position": int(position - first),
            "seed": self.seed,
            "overflow": self.overflow,
            "fingerprint": self.fingerprint,
            "num_docs": int(len(self.lengths)),
            "dp_rank": self.dp_rank,
            "rank": self.pool_rank,
            "segments": [
                {"topology": h["topology"].to_dict(), "cost": h["cost"].to_dict(), "steps": h["steps"]} for h in past
            ]
            + here,
            **extra,
        }
        state["digest"] = state_digest(state)
        return state

    def load_state_dict(self, state: dict) -> None:
        """Resume from `state_dict()` output (see the module docstring for the contract); the next `iter()` yields
        the remainder of the saved epoch."""
        state = check_state(state)
        n = len(self.lengths)
        if state["fingerprint"] != self.fingerprint or state["num_docs"] != n:
            raise ValueError(
                f"the state is from another data set: {state['num_docs']} documents with lengths "
                f"fingerprint {state['fingerprint']}, this sampler has {n} documents with fingerprint "
                f"{self.fingerprint}"
            )
        if state["seed"] != self.seed:
            raise ValueError(f"the state is from seed {state['seed']}, this sampler has seed {self.seed}")
        if state["overflow"] != self.overflow:
            raise ValueError(
                f"the state is from overflow={state['overflow']!r}, this sampler has overflow={self.overflow!r}"
            )
        window_docs = n if state["window_docs"] is None else state["window_docs"]
        # the models this sampler plans with: an attached monitor's fitted ones (adapt mode), restored from the state
        schedule = WindowSchedule(self.topology, self.cost) if self.monitor is None else self.monitor.resume(state)
        mine = schedule.model(state["epoch"], state["window"])
        history, position, _ = resume_chain(state["segments"], state["position"], mine, state["window"])
        windows = EpochWindows(
            self.lengths, self.topology, self.cost, seed=self.seed, epoch=state["epoch"], overflow=self.overflow,
            window_docs=window_docs, origin=state["window"], history=history, guard=self._guard,
            filler_rows=self.filler_rows, schedule=schedule,
        )  # fmt: skip
        if position > windows.micro_batches(state["window"]):
            raise ValueError(
                f"the state's position {position} is past window {state['window']}'s "
                f"{windows.micro_batches(state['window'])} micro-batches"
            )
        self.epoch, self._windows, self.schedule = state["epoch"], windows, schedule
        self._epoch_setup = (windows.window_docs, windows.origin, history)
        self.position, self._cursor = position, (windows.origin, 0)
        self._resume_pending = True
        if self.monitor is not None:
            self.monitor.on_sampler_load()


class _SamplerIter:
    """Iterator over the sampler's remaining micro-batches; Stateful (torchdata) through the sampler."""

    def __init__(self, sampler: BalancedBatchSampler) -> None:
        self.sampler = sampler
        self.passes = sampler._passes  # the pass this iterator reads (set_epoch to another epoch ends it)

    def __iter__(self) -> _SamplerIter:
        return self

    def __next__(self) -> list:
        if self.passes != self.sampler._passes:
            raise RuntimeError(
                f"BalancedBatchSampler: {self.sampler._stale}: this iterator is over; iterate the sampler again"
            )
        return self.sampler._next_indices()

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)
        self.sampler._resume_pending = False
        self.passes = self.sampler._passes  # this iterator reads the loaded pass
