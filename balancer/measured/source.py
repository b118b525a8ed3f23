"""`StepSource`: everything `BalanceMonitor` needs of a source of steps, and nothing else of it.

A step source is whatever hands a training loop its planned steps: `BalancedBatchSampler` (an epoch planned window
by window), `BatchSteps` (fixed batches planned one at a time), `StreamSteps` (a `BalancedStream`'s windows), and
the framework adapters. The monitor reads the plan through these members only, so a source's internals can change
without breaking it:

- who: `topology` and `cost` (the run's own model: the monitor's first), `pool_rank` and `dp_rank` (this process);
- where: `epoch` (the pass being trained) and `position` (micro-batches of this pass handed out, or of a loaded
  state before iterating: whole steps before the current window's segment plus those of it, so `position //
  micro_batches` is the step the next micro-batch belongs to; the monitor counts steps from it when built and
  after every `load_state_dict`);
- what a step was: `step_place(step)` (its window, whether it is the window's last step, its micro-batch count:
  a `balancer.planning.schedule.StepPlace`) and `piece_sizes(step, m, dp_rank=, rank=)` (the token counts of the
  pieces of micro-batch `m` of replica `dp_rank`, or with dynamic CP of pool rank `rank`, and its CP group), for
  any step the monitor has not gathered yet (a source keeps the plans of its last few windows at least);
- how a fit is handed over: `plan_start(epoch, window)` says from which (epoch, window) a model fitted for window
  `window` of pass `epoch` (possibly past that pass's end) can plan, the same on every rank at a gather;
  `update_model(cost, rank_speeds, first_window, epoch=...)` plans the windows from there on with it (adapt mode).
  A window any micro-batch of which was handed out keeps its plan: asking for it is a RuntimeError naming it.
- `monitor`: the attached `BalanceMonitor` (None before); the monitor sets it, and a source saves and loads the
  monitor's state with its own (`monitor.state_dict()`, then after loading `monitor.load_state_dict(...)` and
  `monitor.on_sampler_load()`).

`isinstance(x, StepSource)` checks that the members exist (a `typing.runtime_checkable` Protocol); the contract
above is what they must do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional, Protocol, runtime_checkable

import numpy as np

from balancer.planning.cost.model import CostModel
from balancer.planning.schedule import StepPlace
from balancer.planning.topology import Topology

__all__ = ["STEP_SOURCE_MEMBERS", "StepPlace", "StepSource"]


@runtime_checkable
class StepSource(Protocol):
    """What `BalanceMonitor` needs of a source of steps (module docstring)."""

    monitor: Optional[Any]  # the attached BalanceMonitor; set by the monitor

    @property
    def topology(self) -> Topology:
        """The run's topology (dp, cp, micro_batches, ...; with dynamic CP the units are the pool ranks)."""
        ...

    @property
    def cost(self) -> CostModel:
        """The run's own cost model (what plans every window until a fit replaces it)."""
        ...

    @property
    def pool_rank(self) -> int:
        """This process's pool rank `dp_rank * cp + cp_rank`."""
        ...

    @property
    def dp_rank(self) -> int:
        """This process's DP replica."""
        ...

    @property
    def epoch(self) -> int:
        """The pass being trained (a new one starts the monitor's step count at 0)."""
        ...

    @property
    def position(self) -> int:
        """Micro-batches of this pass handed out so far (module docstring)."""
        ...

    def step_place(self, step: int) -> StepPlace:
        """(window, last step of that window?, micro-batches every rank runs in it) of step `step` of this pass."""
        ...

    def piece_sizes(
        self, step: int, m: int, dp_rank: Optional[int] = None, rank: Optional[int] = None
    ) -> tuple[np.ndarray, Optional[tuple[int, int]]]:
        """(token counts of the pieces of micro-batch `m` of `step` on replica `dp_rank` (dynamic CP: on pool rank
        `rank`), the (start, size) of its dynamic CP group or None in a static plan)."""
        ...

    def plan_start(self, epoch: int, window: int) -> tuple[int, int]:
        """The (epoch, window) a model fitted for window `window` of pass `epoch` plans from (module docstring)."""
        ...

    def update_model(
        self, cost: CostModel, rank_speeds: Optional[Sequence[float]], first_window: int, *, epoch: int
    ) -> None:
        """Plan the windows from (`epoch`, `first_window`) on with `cost` and `rank_speeds` (None: the topology's
        own); a RuntimeError when a micro-batch of that window was handed out already."""
        ...


STEP_SOURCE_MEMBERS = (
    "monitor", "topology", "cost", "pool_rank", "dp_rank", "epoch", "position", "step_place", "piece_sizes",
    "plan_start", "update_model",
)  # fmt: skip
