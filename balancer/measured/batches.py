"""`BatchSteps`: measured balance for loops that plan one fixed batch at a time (`balancer.balance_batch`: RL and
preference batches), where no sampler holds the epoch's plan.

    steps = BatchSteps(topology, cost)                              # every rank
    monitor = balancer.BalanceMonitor(steps, mode="adapt")
    for batch in batches:
        topology, cost = steps.next_model()                         # the same on every rank
        plan = balancer.balance_batch(batch_lengths, topology, cost, mini_batches=K)
        steps.add(plan)                                             # this batch's K steps
        for step in range(plan.num_steps):
            for mb in plan_micro_batches_of_this_rank_in(step):
                with monitor.timer():
                    forward_backward(mb)
            optimizer.step(); monitor.end_step()

Each batch is one of the monitor's windows: after a batch's last step the first rank refits the cost model and the
replica speeds, the fit travels with the next gather (the first step of the next batch, which was planned before it
arrived), so it plans the batch after that one: `next_model()` gives batch `b` the fit of batch `b - 2` or earlier,
the same bits on every rank. `mode="shadow"` measures and reports only (`next_model()` keeps the first model).
This class is the step source (`balancer.measured.StepSource`) `BalanceMonitor` reads the batches' plans through:
the topology and cost, the ranks, the step being closed, the piece sizes of every replica's micro-batches in it, and
where the windows (batches) are; its `WindowSchedule` (`schedule`) keeps the fits `next_model()` plans with.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import TYPE_CHECKING, Optional

from balancer.planning.cost.model import CostModel
from balancer.planning.plans.plan import Plan
from balancer.planning.schedule import StepPlace, WindowSchedule
from balancer.planning.topology import Topology
from balancer.training.indices import CPGroup, Span
from balancer.training.ranks import resolve_pool_rank
from balancer.training.segments import piece_sizes

if TYPE_CHECKING:
    from balancer.measured.monitor import BalanceMonitor

_KEPT = 4  # batches whose plans are kept: a gather reads the plan of a step closed up to `every` steps before


class BatchSteps:
    """A step source for `BalanceMonitor` over fixed batches added one at a time (`add(plan)`), each planned with
    `next_model()`. `topology` (dp, cp, cp_sizes, micro_batches; whole plans) and `cost` are the first batch's
    model; `dp_rank` / `rank` as in `BalancedBatchSampler` (default: from torch.distributed)."""

    def __init__(
        self, topology: Topology, cost: CostModel, *, dp_rank: Optional[int] = None, rank: Optional[int] = None
    ) -> None:
        if not isinstance(topology, Topology):
            raise TypeError(f"BatchSteps: topology must be a Topology, got {type(topology).__name__}")
        if not isinstance(cost, CostModel):
            raise TypeError(f"BatchSteps: cost must be a CostModel, got {type(cost).__name__}")
        self.topology, self.cost = topology, cost
        self.pool_rank = resolve_pool_rank(rank, dp_rank, topology, None, "dp")
        self.dp_rank = self.pool_rank // topology.cp
        self.monitor: Optional[BalanceMonitor] = None  # set by BalanceMonitor
        self.epoch = 0
        self.schedule = WindowSchedule(topology, cost)  # the fits the monitor hands over (adapt mode), by batch
        self._kept: dict[int, tuple[int, Plan]] = {}  # batch index -> (its first step, its plan), the last _KEPT
        self._batches = self._steps = 0

    # ---- the loop's side ----------------------------------------------------------------------------------------
    def add(self, plan: Plan) -> None:
        """The next batch's plan (`balance_batch` with the topology and cost of `next_model()`): its steps follow the
        ones added before."""
        if self.monitor is None:
            raise ValueError("BatchSteps.add: build the BalanceMonitor on these steps before adding the first batch")
        if not isinstance(plan, Plan):
            raise TypeError(f"BatchSteps.add: plan must be a balancer Plan, got {type(plan).__name__}")
        t, mine = plan.topology, self.topology
        for name in ("dp", "cp", "pp", "micro_batches", "cp_sizes"):
            if getattr(t, name) != getattr(mine, name):
                raise ValueError(
                    f"BatchSteps.add: the plan has {name} = {getattr(t, name)}, the monitor's topology "
                    f"{getattr(mine, name)} (every batch keeps dp, cp, pp, cp_sizes and micro_batches: pass "
                    "micro_batches to balance_batch as a number, not 'auto')"
                )
        self._kept[self._batches] = (self._steps, plan)
        self._kept.pop(self._batches - _KEPT, None)
        self._batches += 1
        self._steps += plan.num_steps

    def next_model(self) -> tuple[Topology, CostModel]:
        """(topology with the fitted `rank_speeds`, cost) to plan the next batch with: the same on every rank."""
        return self.schedule.model(0, self._batches)

    @property
    def batches(self) -> int:
        """Batches added so far."""
        return self._batches

    def state_dict(self) -> dict:
        """Batches and steps so far and the monitor's state (JSON-able): `load_state_dict` continues from here."""
        if self.monitor is None:
            raise ValueError("BatchSteps.state_dict: build the BalanceMonitor on these steps first")
        return {"batches": self._batches, "steps": self._steps, "monitor": self.monitor.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Resume (before the next `add`): the next batch added is batch `state["batches"]`, planned with the model
        the uninterrupted run would have used."""
        if self.monitor is None:
            raise ValueError("BatchSteps.load_state_dict: build the BalanceMonitor on these steps first")
        batches, steps = _checked_counts(state)
        self._batches, self._steps, self._kept = batches, steps, {}
        self.schedule = self.monitor.resume({"monitor": state["monitor"]})
        self.monitor.on_sampler_load()

    # ---- what BalanceMonitor reads (balancer.measured.StepSource) ---------------------------------------------------
    @property
    def position(self) -> int:
        """Micro-batches of the batches added (the monitor starts counting steps here when built or resumed)."""
        return self._steps * self.topology.micro_batches

    @property
    def num_steps(self) -> int:
        return self._steps

    def step_place(self, step: int) -> StepPlace:
        """(batch, last step of it?, micro-batches every rank runs in it) of global step `step`."""
        b, local = self.locate(step)
        plan = self._kept[b][1]
        return StepPlace(b, local == plan.num_steps - 1, plan.step_micro_batches(local))

    def plan_start(self, epoch: int, window: int) -> tuple[int, int]:
        """Batches are not known ahead: a fit for batch `window` plans from it."""
        return epoch, window

    def update_model(
        self, cost: CostModel, rank_speeds: Optional[Sequence[float]], first_window: int, *, epoch: int = 0
    ) -> None:
        """A fit for batches `first_window`..: `next_model()` plans with it; a batch already added keeps its plan
        (a RuntimeError when `first_window` is one)."""
        if first_window < self._batches:
            raise RuntimeError(
                f"BalanceMonitor: the refit for batch {first_window} arrived after it was planned and added (batches "
                f"added: {self._batches}): gather every step (every=1) or give batches more steps"
            )
        self.schedule.update(cost, rank_speeds, first_window, epoch=epoch)

    def locate(self, step: int) -> tuple[int, int]:
        """(batch, step within it) of global step `step` (a batch still kept)."""
        for b, (first, plan) in self._kept.items():
            if first <= step < first + plan.num_steps:
                return b, step - first
        raise ValueError(f"step {step} is not in the last {_KEPT} batches added to BatchSteps")

    def steps(self, window: int) -> int:
        return self._kept[window][1].num_steps

    def step_micro_batches(self, step: int) -> int:
        b, local = self.locate(step)
        return self._kept[b][1].step_micro_batches(local)

    def micro_batch(self, step: int, m: int, dp_rank: int | None = None, rank: int | None = None) -> list[Span]:
        """The pieces of micro-batch `m` of `step` on replica `dp_rank` (their sizes are what the monitor needs);
        dynamic CP: of slot `m` on pool rank `rank`, each piece carrying its CP group."""
        plan, k = self._micro_batch_at(step, m, dp_rank, rank)
        group = None
        if plan.dynamic:
            assert rank is not None, "_micro_batch_at refuses a dynamic plan's micro-batch without a rank"
            group_start, group_size, _ = plan.group_arrays
            start = int(group_start[k])
            group = CPGroup(start, int(group_size[k]), rank - start)
        a, z = int(plan.mb_ptr[k]), int(plan.mb_ptr[k + 1])
        return [Span(d, s, e, group) for d, s, e in zip(plan.doc[a:z], plan.start[a:z], plan.end[a:z])]

    def piece_sizes(self, step: int, m: int, dp_rank: int | None = None, rank: int | None = None) -> tuple:
        """(token counts of `micro_batch`'s pieces, a dynamic plan's CP group (start, size) or None)."""
        plan, k = self._micro_batch_at(step, m, dp_rank, rank)
        return piece_sizes(plan, k, 0 if rank is None else rank, plan.dynamic)  # static plans: no group, no rank

    def _micro_batch_at(self, step: int, m: int, dp_rank: int | None, rank: int | None) -> tuple[Plan, int]:
        """The kept plan holding `step` and the index of micro-batch `m` of it on `dp_rank` (dynamic: the group of
        slot `m` holding pool rank `rank`)."""
        b, local = self.locate(step)
        plan = self._kept[b][1]
        if plan.dynamic:
            if rank is None:
                raise ValueError("a dynamic-CP plan's micro-batches are per pool rank: pass rank")
            return plan, int(plan.rank_groups(rank)[local * plan.topology.micro_batches + m])
        if dp_rank is None:
            raise ValueError("pass dp_rank: the micro-batch of which replica")
        return plan, local * plan.topology.bins_per_step + dp_rank * plan.step_micro_batches(local) + m


def _checked_counts(state: object) -> tuple[int, int]:
    """(batches, steps) of a `BatchSteps.state_dict()`: integers >= 0 (not bools), at least one step per batch, and
    a "monitor" part; a ValueError naming the key otherwise."""
    if not isinstance(state, dict):
        raise ValueError(f"BatchSteps.load_state_dict: the state must be a dict, got {type(state).__name__}")
    for key in ("batches", "steps", "monitor"):
        if key not in state:
            raise ValueError(f"BatchSteps.load_state_dict: the state has no {key!r} (not a BatchSteps.state_dict())")
    for key in ("batches", "steps"):
        value = state[key]
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(
                f"BatchSteps.load_state_dict: state[{key!r}] must be an integer >= 0, got {type(value).__name__} "
                f"{value!r}"
            )
    if state["steps"] < state["batches"]:
        raise ValueError(
            f"BatchSteps.load_state_dict: state['steps'] = {state['steps']} is fewer than state['batches'] = "
            f"{state['batches']} (every batch has at least one step)"
        )
    return int(state["batches"]), int(state["steps"])
