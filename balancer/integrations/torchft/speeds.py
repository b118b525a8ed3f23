"""Measured speeds of replica groups, keyed by the user's `replica_id` (stable over restarts and membership changes;
torchft's own id gains a fresh uuid on every restart).

Each committed step adds every contributing group's last measured step: the seconds its micro-batches' forward +
backward took and the predicted cost (cost-model units per CP rank) of the work it was planned. A group's speed is
`predicted / seconds`; its current speed is the median of its last `recent` steps, so a group that slows down
(a throttled device) is noticed within `recent` steps: when that median falls below `1 - slow_drop` of the median
of its steps before them, the slowdown is logged (once, until it recovers) and listed in `report()["slowed"]`. A
group whose step took longer than `stall_seconds` is logged and listed by identity in `report()["stalled"]`, and a
group that leaves the contributors (died, evicted, stalled past torchft's timeouts) is listed with the step in
`report()["departed"]`. The tracker is part of the data state (`state_dict`), so it survives restarts and reaches a
rejoining group with torchft's state transfer.
"""

from __future__ import annotations

import logging
from typing import Optional

import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["ReplicaSpeeds", "EVEN_SPEEDS"]

EVEN_SPEEDS = 1.1  # planned speeds whose fastest / slowest is below this are planned as even
_EVENTS = 256  # the most events of each kind kept


class ReplicaSpeeds:
    """Speeds per `replica_id` (module docstring). `recent`: steps of the current speed; `history`: steps kept
    per replica; `slow_drop`: the fall that counts as a slowdown; `stall_seconds`: a step's compute past this is
    a stall (None: not checked)."""

    def __init__(
        self, *, recent: int = 3, history: int = 32, slow_drop: float = 0.25, stall_seconds: Optional[float] = None
    ) -> None:
        if not (isinstance(recent, int) and 1 <= recent < history):
            raise ValueError(f"recent must be an integer in 1 .. history - 1, got {recent!r}")
        if not 0 < slow_drop < 1:
            raise ValueError(f"slow_drop must be in (0, 1), got {slow_drop!r}")
        if stall_seconds is not None and not stall_seconds > 0:
            raise ValueError(f"stall_seconds must be a positive number of seconds or None, got {stall_seconds!r}")
        self.recent, self.history, self.slow_drop, self.stall_seconds = recent, history, slow_drop, stall_seconds
        self.ratios: dict[str, list[float]] = {}
        self.slowed: dict[str, dict] = {}  # replica -> the slowdown in force
        self.events: dict[str, list[dict]] = {"slowed": [], "stalled": [], "departed": [], "joined": []}
        self.members: list[str] = []

    # ---- input ------------------------------------------------------------------------------------------------
    def observe(self, step: int, replica_id: str, predicted: float, seconds: float) -> None:
        """One measured step of `replica_id` (`predicted` cost units in `seconds`), added at global `step`."""
        if not (seconds > 0 and predicted > 0):
            return
        if self.stall_seconds is not None and seconds > self.stall_seconds:
            self._event("stalled", {"step": step, "replica_id": replica_id, "seconds": seconds})
            logger.warning(
                "replica %s stalled: its step took %.3g s (stall_seconds = %g)", replica_id, seconds, self.stall_seconds
            )
        kept = self.ratios.setdefault(replica_id, [])
        kept.append(predicted / seconds)
        del kept[: -self.history]
        self._check_slow(step, replica_id)

    def members_at(self, step: int, replica_ids: list[str]) -> None:
        """The contributors of committed `step`: departures and arrivals against the step before are events."""
        for r in self.members:
            if r not in replica_ids:
                self._event("departed", {"step": step, "replica_id": r})
                logger.warning("replica %s left the contributing groups at step %d", r, step)
        for r in replica_ids:
            if r not in self.members:
                self._event("joined", {"step": step, "replica_id": r})
        self.members = list(replica_ids)

    def _event(self, kind: str, record: dict) -> None:
        self.events[kind].append(record)
        del self.events[kind][:-_EVENTS]

    def _check_slow(self, step: int, replica_id: str) -> None:
        kept = self.ratios[replica_id]
        if len(kept) < 2 * self.recent:
            return
        before = float(np.median(kept[-4 * self.recent : -self.recent]))
        now = self.speed(replica_id)
        if now is None:  # no step measured yet (kept holds this replica's steps: not reached)
            return
        if replica_id not in self.slowed and now < (1 - self.slow_drop) * before:
            record = {"step": step, "replica_id": replica_id, "before": before, "now": now}
            self.slowed[replica_id] = record
            self._event("slowed", record)
            logger.warning(
                "replica %s slowed down at step %d: speed %.4g -> %.4g (%.0f%%)",
                replica_id,
                step,
                before,
                now,
                100 * now / before,
            )
        elif replica_id in self.slowed and now >= (1 - self.slow_drop / 2) * self.slowed[replica_id]["before"]:
            del self.slowed[replica_id]
            logger.info("replica %s is back to speed %.4g at step %d", replica_id, now, step)

    # ---- output -----------------------------------------------------------------------------------------------
    def speed(self, replica_id: str) -> Optional[float]:
        """The current speed of `replica_id` (median of its last `recent` steps); None before its first."""
        kept = self.ratios.get(replica_id)
        return float(np.median(kept[-self.recent :])) if kept else None

    def report(self) -> dict:
        return {
            "speeds": {r: self.speed(r) for r in sorted(self.ratios)},
            "slowed_now": sorted(self.slowed),
            **{k: list(v) for k, v in self.events.items()},
        }

    def state_dict(self) -> dict:
        return {
            "ratios": {k: list(v) for k, v in self.ratios.items()},
            "slowed": dict(self.slowed),
            "events": {k: list(v) for k, v in self.events.items()},
            "members": list(self.members),
        }

    def load_state_dict(self, state: dict) -> None:
        self.ratios = {str(k): [float(x) for x in v] for k, v in state["ratios"].items()}
        self.slowed = {str(k): dict(v) for k, v in state["slowed"].items()}
        self.events = {k: [dict(e) for e in state["events"].get(k, [])] for k in self.events}
        self.members = [str(x) for x in state["members"]]


def plan_speeds(estimates: list[float]) -> Optional[tuple[float, ...]]:
    """The `rank_speeds` to plan contributors with from their estimates (0: unknown, given the median of the known
    ones); None (even) when none is known or the fastest is within EVEN_SPEEDS of the slowest."""
    known = [s for s in estimates if s > 0]
    if not known:
        return None
    fill = float(np.median(known))
    s = np.array([x if x > 0 else fill for x in estimates])
    if s.max() < EVEN_SPEEDS * s.min():
        return None
    return tuple(float(x) for x in s / s.max())
