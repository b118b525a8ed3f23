"""What `BalanceMonitor` sees of `FaultTolerantBatches`: a `balancer.measured.StepSource` whose one unit is this
replica group (the group named by the user's `replica_id`).

    batches = FaultTolerantBatches(lengths, topology, cost, replica_id="group-3")
    monitor = balancer.BalanceMonitor(batches, mode="adapt")      # group=: the group's own process group (CP)
    ...                                                           # the loop of batches.py; time with batches.timer()

torchft's replica groups share no process group that outlives a failure, so the monitor of each process measures
its own replica group: its view (`topology`) is one replica of `run_topology.cp` ranks running up to `dp * M`
micro-batches a step (all of the failure-free step's, when the group alone contributes; a step with fewer has
empty, untimed micro-batches after its own). `batches.end_step(True)` hands the monitor the committed step this
group contributed to: each micro-batch's seconds (timed with `batches.timer()`), then `monitor.end_step()`; a step
that does not commit is never measured, a step this group sat out is skipped. The monitor counts the committed
steps of the epoch (`position`).

The speeds of the groups, compared with one another and keyed by `replica_id` (slowdowns, stalls, departures), are
`ReplicaSpeeds`': every group's last measured step travels in the step exchange. A cost model the monitor fits in
adapt mode (`update_model`) is this group's proposal from the window the monitor names: the one in force at the
group's data position travels in the exchange, and every contributor plans a step with the proposal of the first
contributor (by participating rank) that has one, or with the run's own `cost`: the same plan on every group
whatever each one fitted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np

from balancer.integrations.torchft.exchange import FIT, Row
from balancer.planning.cost.fit import TERMS
from balancer.planning.cost.model import CostModel
from balancer.planning.schedule import StepPlace, plan_start
from balancer.planning.shuffle import num_windows
from balancer.planning.topology import Topology
from balancer.training.indices import Span

__all__ = ["MonitoredSteps", "monitor_view", "pack_fit", "plan_cost", "piece_lengths"]

KEEP_STEPS = 64  # committed steps whose plan the monitor can still read


def monitor_view(run: Topology) -> Topology:
    """The monitor's topology: one replica of `run.cp` ranks and up to `run.dp * run.micro_batches` micro-batches."""
    return Topology(dp=1, cp=run.cp, pp=run.pp, micro_batches=run.dp * run.micro_batches, max_tokens=run.max_tokens)


def piece_lengths(mb: list, lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token counts of the pieces of micro-batch `mb` (document ids and `Span`s)."""
    return np.array([(x.end - x.start) if isinstance(x, Span) else int(lengths[int(x)]) for x in mb], dtype=np.int64)


def pack_fit(cost: Optional[CostModel], epoch: int, window: int) -> tuple:
    """A proposal as it travels in a `Row` (`FIT` floats; all 0: none)."""
    if cost is None:
        return (0.0,) * FIT
    return (1.0, float(epoch), float(window), float(cost.comm_overlap), *(float(getattr(cost, n)) for n in TERMS))


def plan_cost(rows: list[Row], base: CostModel) -> CostModel:
    """The cost model a step at `rows[0]`'s position is planned with: the first row's proposal in force there, else
    `base` (module docstring)."""
    here = (rows[0].epoch, rows[0].window)
    for r in rows:
        flag, epoch, window, overlap = r.fit[:4]
        if flag == 1.0 and (int(epoch), int(window)) <= here:
            values: dict[str, Any] = dict(zip(TERMS, (float(x) for x in r.fit[4:])))
            return dataclasses.replace(base, **values, comm_overlap=bool(overlap))
    return base


class MonitoredSteps:
    """The `StepSource` members of `FaultTolerantBatches` (module docstring). The host sets `run_topology`, `cost`,
    `lengths`, `epoch`, `window`, `window_docs`, `epoch_steps`, `cp_rank`, `windows` (the epoch's `EpochWindows`)
    and calls `_init_monitored()`."""

    run_topology: Topology
    cost: CostModel
    lengths: Any
    epoch: int
    window: int
    epoch_steps: int
    window_docs: int
    cp_rank: int
    windows: Any

    def _init_monitored(self) -> None:
        self.monitor: Optional[Any] = None
        self._view = monitor_view(self.run_topology)
        self._measured: dict[int, tuple[StepPlace, list[np.ndarray]]] = {}  # epoch step -> place, piece sizes
        self.fits: list[tuple[int, int, CostModel]] = []  # this group's proposals: (epoch, window, cost), in order

    @property
    def topology(self) -> Topology:
        """The monitor's view: this replica group as one replica (module docstring); the failure-free run's
        topology is `run_topology`."""
        return self._view

    @property
    def pool_rank(self) -> int:
        return self.cp_rank

    @property
    def dp_rank(self) -> int:
        return 0

    @property
    def position(self) -> int:
        """Committed steps of this epoch, in the view's micro-batches (`position // micro_batches` is the step)."""
        return self.epoch_steps * self._view.micro_batches

    def step_place(self, step: int) -> StepPlace:
        """The place of committed step `step` of this epoch that this group measured (the last KEEP_STEPS)."""
        if int(step) not in self._measured:
            raise IndexError(f"step {step}: not a committed step this replica group measured in the last {KEEP_STEPS}")
        return self._measured[int(step)][0]

    def piece_sizes(
        self, step: int, m: int, dp_rank: Optional[int] = None, rank: Optional[int] = None
    ) -> tuple[np.ndarray, Optional[tuple[int, int]]]:
        """Token counts of the pieces of this group's micro-batch `m` of committed step `step` (empty past the
        step's own micro-batches); static CP (None)."""
        if dp_rank not in (None, 0) or (rank is not None and not 0 <= rank < self._view.cp):
            raise IndexError(f"dp_rank={dp_rank}, rank={rank}: the monitor's view of a replica group has one replica")
        self.step_place(step)
        sizes = self._measured[int(step)][1]
        return (sizes[m] if 0 <= m < len(sizes) else np.zeros(0, dtype=np.int64)), None

    def plan_start(self, epoch: int, window: int) -> tuple[int, int]:
        """As `BalancedBatchSampler.plan_start`: past the epoch's last window into the next epochs; an epoch left
        behind plans from the next one (`balancer.planning.schedule.plan_start`)."""
        return plan_start(
            epoch, window, current_epoch=self.epoch, current_windows=self.windows.count,
            epoch_windows=num_windows(len(self.lengths), self.window_docs),
        )  # fmt: skip

    def update_model(
        self, cost: CostModel, rank_speeds: Optional[Sequence[float]], first_window: int, *, epoch: int
    ) -> None:
        """Propose `cost` for the steps from (`epoch`, `first_window`) on, in place of earlier proposals from there
        on (module docstring). `rank_speeds` is the view's one replica's and plans nothing: the groups' speeds are
        `ReplicaSpeeds`'."""
        start = (int(epoch), int(first_window))
        self.fits = [f for f in self.fits if f[:2] < start] + [(*start, cost)]

    def fit_row(self) -> tuple:
        """This group's proposal in force at its data position, as it travels in its row (none: zeros)."""
        here = [f for f in self.fits if f[:2] <= (self.epoch, self.window)]
        return pack_fit(None, 0, 0) if not here else pack_fit(here[-1][2], here[-1][0], here[-1][1])

    def measure(self, place: StepPlace, items: list, seconds: list[float]) -> None:
        """Hand the monitor committed step `epoch_steps` (this group's micro-batches `items`, timed `seconds`);
        call before the data position moves on."""
        if self.monitor is None or not items:
            return
        if len(seconds) != len(items):
            raise RuntimeError(
                f"replica group step {self.epoch_steps}: {len(seconds)} micro-batches timed of {len(items)}; with a "
                "BalanceMonitor attached, time every micro-batch with batches.timer() (or batches.record)"
            )
        step = self.epoch_steps
        self._measured[step] = (place, [piece_lengths(mb, self.lengths) for mb in items])
        for old in [k for k in self._measured if k <= step - KEEP_STEPS]:
            del self._measured[old]
        for m in range(self._view.micro_batches):
            self.monitor.record(seconds[m] if m < len(seconds) else 0.0, step=step, micro_batch=m)
        self.monitor.end_step()

    def fit_state(self) -> list[dict]:
        return [{"epoch": e, "window": w, "cost": c.to_dict()} for e, w, c in self.fits]

    def load_fit_state(self, state: list[dict]) -> None:
        self.fits = [(int(f["epoch"]), int(f["window"]), CostModel.from_dict(f["cost"])) for f in state]
