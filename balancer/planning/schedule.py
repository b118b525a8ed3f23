"""`WindowSchedule`: which model plans window w, the plan segments kept for resume, their state schema and the
mid-step rule: the one owner of these rules for the sampler, the stream and the monitor (no torch).

Which model plans a window. A schedule starts from a run's own (topology, cost model); `update(cost, rank_speeds,
first_window, epoch=e)` plans the windows from (e, first_window) on with a new cost model and replica speeds (a
measured refit). Window w of pass e is planned with the last update, in call order, that starts at or before (e, w),
else the run's own model. `new_pass(e)` starts a pass whose windows all take the latest model (a stream, whose pass
has no known window count). The sampler, the stream and `BalanceMonitor` each hold one schedule.

The segment chain. A window's plan may be made in segments: after a resume onto another topology or cost model,
what is left of the window is re-planned after the segments consumed before. A resume state holds the chain as
`[{"topology", "cost", "steps"}]`, the last one in use (`steps` null), every earlier one with the steps consumed
(`SEGMENT`, `segments_state`, `parse_segments`).

The mid-step rule (`resume_chain`): a state resumes at any micro-batch onto the model its window was planned with;
onto another model only at a step boundary (`position % micro_batches == 0`: every rank has finished the optimizer
step), the segment in use then closes with the steps consumed and the rest of the window is re-planned. A mid-step
state onto another model is refused.

The seed rule: seeds are integers in 0 .. 2**63-1 (`check_seed`, `SEED`), what every state holds as int64.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import numpy as np

from balancer.planning.cost.model import CostModel
from balancer.planning.topology import Topology
from balancer.planning.units import check_topology_and_cost
from balancer.planning.window import MAX_SEED
from balancer.strict_json import anything, array, integer, number, obj

log = logging.getLogger(__name__)

SEED = integer(min=0, max=MAX_SEED)  # a state's "seed"
SEGMENT = obj({"topology": anything(), "cost": anything(), "steps": integer(min=0, nullable=True)})
MODEL_CHANGE = obj(
    {"first_window": integer(min=0), "cost": anything(), "rank_speeds": array(number(min=0), nullable=True)}
)


class StepPlace(NamedTuple):
    """Where a step sits: its `window`, whether it is that window's `last` step, and the `micro_batches` every rank
    runs in it (M, or M' < M in a short last step)."""

    window: int
    last: bool
    micro_batches: int


@dataclass(frozen=True)
class ModelChange:
    """The windows from (`epoch`, `window`) on are planned with `cost` and `rank_speeds` (None: the run's own)."""

    epoch: int
    window: int
    cost: CostModel
    rank_speeds: Optional[tuple[float, ...]]

    @property
    def start(self) -> tuple[int, int]:
        return self.epoch, self.window


def check_seed(seed: Any) -> int:
    """`seed` as an int, or a ValueError: seeds are integers in 0 .. 2**63-1 (what a resume state holds)."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed must be an integer in 0 .. 2**63-1 (what a resume state holds), got {seed!r}")
    return int(seed)


def _index(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"update_model: {name} must be a non-negative integer, got {value!r}")
    return int(value)


class WindowSchedule:
    """The model each window is planned with (module docstring), from `topology` and `cost` (the run's own)."""

    def __init__(self, topology: Topology, cost: CostModel) -> None:
        check_topology_and_cost(topology, cost)
        self.topology, self.cost = topology, cost
        self.changes: list[ModelChange] = []

    def copy(self) -> WindowSchedule:
        out = WindowSchedule(self.topology, self.cost)
        out.changes = list(self.changes)
        return out

    def index(self, epoch: int, window: int) -> int:
        """0 when window `window` of pass `epoch` takes the run's own model, else 1 + the index of its change."""
        found = 0
        for i, change in enumerate(self.changes, 1):
            if change.start <= (epoch, window):
                found = i
        return found

    def topology_with(self, rank_speeds: Optional[Sequence[float]]) -> Topology:
        """The run's topology with `rank_speeds` (None: its own); refused where this Topology takes no speeds."""
        if rank_speeds is None:
            return self.topology
        if "rank_speeds" not in {f.name for f in dataclasses.fields(Topology)}:
            raise ValueError("update_model: this planner's Topology takes no rank_speeds (pass None)")
        return dataclasses.replace(self.topology, rank_speeds=tuple(float(s) for s in rank_speeds))

    def model(self, epoch: int, window: int) -> tuple[Topology, CostModel]:
        """(topology, cost model) window `window` of pass `epoch` is planned with."""
        i = self.index(epoch, window)
        if i == 0:
            return self.topology, self.cost
        change = self.changes[i - 1]
        return self.topology_with(change.rank_speeds), change.cost

    def update(
        self, cost: CostModel, rank_speeds: Optional[Sequence[float]], first_window: int, *, epoch: int = 0
    ) -> ModelChange:
        """Plan the windows from (`epoch`, `first_window`) on with `cost` and `rank_speeds` (one positive speed per
        DP replica, or pool rank with dynamic CP; None: the topology's own). Checked here, for every holder alike."""
        if not isinstance(cost, CostModel):
            raise TypeError(f"update_model: cost must be a CostModel, got {type(cost).__name__}")
        first_window, epoch = _index(first_window, "first_window"), _index(epoch, "epoch")
        speeds = None if rank_speeds is None else self.topology_with(rank_speeds).rank_speeds
        change = ModelChange(epoch, first_window, cost, speeds)
        self.changes.append(change)
        return change

    def new_pass(self, epoch: int) -> None:
        """A new pass over `epoch`: every one of its windows takes the latest model."""
        self.changes = [dataclasses.replace(c, epoch=int(epoch), window=0) for c in self.changes[-1:]]

    def changes_from(self, epoch: int, window: int) -> bool:
        """Whether a change starts at or after (epoch, window) (a plan made before it may be out of date)."""
        return any(c.start >= (epoch, window) for c in self.changes)

    # ---- state -------------------------------------------------------------------------------------------------
    def changes_state(self) -> list[dict]:
        """The changes as a stream state holds them (`MODEL_CHANGE`; their pass is the state's epoch)."""
        return [
            {"first_window": c.window, "cost": c.cost.to_dict(),
             "rank_speeds": None if c.rank_speeds is None else list(c.rank_speeds)}
            for c in self.changes
        ]  # fmt: skip

    def load_changes(self, records: list, epoch: int, what: str) -> None:
        """Replace the changes by `records` (`MODEL_CHANGE`, checked) of pass `epoch`; speeds for another number of
        replicas than this topology's are dropped with a warning (the run resumed on another DP size)."""
        changes = []
        for i, m in enumerate(records):
            try:
                cost = CostModel.from_dict(m["cost"])
            except (ValueError, TypeError, KeyError) as e:
                raise ValueError(f'{what}: "models[{i}].cost": {e}') from None
            speeds = None if m["rank_speeds"] is None else tuple(float(s) for s in m["rank_speeds"])
            if speeds is not None and len(speeds) != self.topology.dp:
                log.warning(
                    "the state's rank speeds from window %d are for %d replicas, this run has dp=%d: planning "
                    "without them", m["first_window"], len(speeds), self.topology.dp,
                )  # fmt: skip
                speeds = None
            changes.append(ModelChange(int(epoch), int(m["first_window"]), cost, speeds))
        self.changes = changes


def plan_start(
    epoch: int, window: int, *, current_epoch: int, current_windows: int, epoch_windows: int
) -> tuple[int, int]:
    """The window-wrapping rule: the (epoch, window) a model fitted for window `window` of `epoch` plans from, for a
    holder at pass `current_epoch` whose pass has `current_windows` windows and whose other passes have
    `epoch_windows` each. Past an epoch's last window it wraps into the next epochs; a model for an epoch the holder
    has left plans from the next one (the current epoch's windows may already be planned, differently on different
    ranks)."""
    if current_windows < 1 or epoch_windows < 1:
        raise ValueError(f"plan_start: window counts must be positive, got {current_windows} and {epoch_windows}")
    while True:
        count = current_windows if epoch == current_epoch else epoch_windows
        if window < count:
            break
        epoch, window = epoch + 1, window - count
    return (current_epoch + 1, 0) if epoch < current_epoch else (epoch, window)


# ---- the segment chain ---------------------------------------------------------------------------------------------
def segments_state(chain: Sequence[dict]) -> list[dict]:
    """A chain of segments (`topology`, `cost`, `steps`) as a state holds it (`SEGMENT`)."""
    return [{"topology": s["topology"].to_dict(), "cost": s["cost"].to_dict(), "steps": s["steps"]} for s in chain]


def parse_segments(segs: list, what: str) -> list[dict]:
    """A state's `segments` (checked against `SEGMENT`) as objects; a ValueError names `what` state and the segment:
    a non-empty chain, every segment's `steps` an integer but the last one's, null (the segment in use)."""
    if not segs:
        raise ValueError(f'{what}: "segments": expected a non-empty list')
    parsed = []
    for i, seg in enumerate(segs):
        where = f"segments[{i}]"
        try:
            topology, cost = Topology.from_dict(seg["topology"]), CostModel.from_dict(seg["cost"])
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f'{what}: "{where}": {e}') from None
        last = i == len(segs) - 1
        if last != (seg["steps"] is None):
            expected = "null (the segment in use)" if last else "the steps consumed (an integer)"
            raise ValueError(f'{what}: "{where}.steps": expected {expected}, got {seg["steps"]!r}')
        parsed.append({"topology": topology, "cost": cost, "steps": seg["steps"]})
    return parsed


def resume_chain(
    segments: list[dict], position: int, mine: tuple[Topology, CostModel], window: int
) -> tuple[list[dict], int, int]:
    """The mid-step rule (module docstring) for a state at micro-batch `position` of window `window`'s segment in
    use (`segments`, parsed) resumed by a run that plans that window with `mine` (topology, cost): (the segments
    consumed before, the position in the segment the run plans now, the steps the closed segment consumed: 0 when
    the model is the same). A mid-step state onto another model: one ValueError naming the step."""
    history = [dict(s) for s in segments[:-1]]
    last = segments[-1]
    if (last["topology"], last["cost"]) == tuple(mine):
        return history, position, 0
    m = last["topology"].micro_batches
    if position % m:
        raise ValueError(
            f"the state is mid-step (micro-batch {position % m} of step {position // m}) of window {window} planned "
            f"for {last['topology']}; it resumes only onto the same topology and cost model. Save at a step "
            f"boundary to change the topology (now {mine[0]})"
        )
    history.append({"topology": last["topology"], "cost": last["cost"], "steps": position // m})
    return history, 0, position // m


__all__ = [
    "MODEL_CHANGE",
    "SEED",
    "SEGMENT",
    "ModelChange",
    "StepPlace",
    "WindowSchedule",
    "check_seed",
    "parse_segments",
    "plan_start",
    "resume_chain",
    "segments_state",
]
