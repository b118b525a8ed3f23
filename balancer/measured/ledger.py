"""What the monitor keeps of the measured steps: per step the measured and predicted time of every replica and every
rank's compute seconds; per micro-batch the measured and predicted seconds (for the prediction errors); and a
bounded buffer of micro-batch compositions with their times (the refit's evidence). Everything here is built from
the gathered measurements and the plan alone, so it is the same on every rank."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from balancer.measured.refit import Samples, predict
from balancer.planning.cost.model import CostModel
from balancer.planning.speeds import group_speeds

STATE_STEPS = 512  # steps of per-step records a saved state keeps (the report of a resumed run starts there)


@dataclass
class Model:
    """A model in force from (epoch, window) on: the cost model, the replica speeds it was fitted with (None: all
    1), whether its units are seconds (fitted) and the speeds the planner was given (None: none)."""

    cost: CostModel
    speeds: tuple | None
    in_seconds: bool
    start: tuple = (0, 0)
    plan_speeds: tuple | None = None
    fresh_from: int = 0  # the first ledger step measured after this model was fitted

    def to_dict(self) -> dict:
        return {
            "cost": self.cost.to_dict(),
            "speeds": None if self.speeds is None else list(self.speeds),
            "in_seconds": self.in_seconds,
            "start": list(self.start),
            "plan_speeds": None if self.plan_speeds is None else list(self.plan_speeds),
            "fresh_from": self.fresh_from,
        }

    @classmethod
    def from_dict(cls, d: dict) -> Model:
        speeds = None if d["speeds"] is None else tuple(float(s) for s in d["speeds"])
        plan = None if d["plan_speeds"] is None else tuple(float(s) for s in d["plan_speeds"])
        start = (int(d["start"][0]), int(d["start"][1]))
        return cls(CostModel.from_dict(d["cost"]), speeds, bool(d["in_seconds"]), start, plan, int(d["fresh_from"]))


@dataclass
class Ledger:
    """Measured steps (see the module docstring). `max_samples` bounds the refit's evidence (the most recent)."""

    dp: int
    max_samples: int
    layout: str = "zigzag"
    steps: list = field(default_factory=list)  # dicts: epoch, step, window, model, warm, measured, predicted, ranks
    # [model, replica, measured, predicted units, serial, left out, m, group start, group size] (static: replica, 1)
    mb: list = field(default_factory=list)
    # (serial, replica, cp, sizes, seconds, left out: warm-up or synced, (group start, size))
    samples: deque = field(init=False)

    def __post_init__(self) -> None:
        self.samples = deque(maxlen=self.max_samples)

    def add_step(
        self,
        info: dict,
        model_id: int,
        model: Model,
        sizes: list,
        cp: int | np.ndarray,
        seconds: np.ndarray,
        rank_seconds: np.ndarray,
        synced: np.ndarray,
        groups: Optional[np.ndarray] = None,
    ) -> None:
        """One gathered step: `sizes[r][m]` the piece sizes of replica r's micro-batch m, `cp` its CP size (one
        number, or [dp, M]), `seconds` [dp, M] the slowest rank of each replica, `rank_seconds` [ranks] each rank's
        compute, `synced` [M] micro-batches whose time includes the gradient reduction (left out of the step times,
        the errors and the fit). Dynamic CP: the "replicas" are the pool ranks, `groups` [pool, M, 2] the (start,
        size) of each one's group, which runs at its slowest member's planned speed."""
        serial = len(self.steps)
        seconds = np.asarray(seconds, dtype=np.float64)
        cps = np.broadcast_to(np.asarray(cp, dtype=np.int64), seconds.shape)
        flat = [s for per in sizes for s in per]
        units = predict(model.cost, flat, cps.ravel(), self.layout).reshape(seconds.shape)
        plan_cost = np.array([[model.cost.micro_batch_cost(s) / c for s, c in zip(per, cs)] for per, cs in
                              zip(sizes, cps)]).reshape(seconds.shape)  # fmt: skip
        plan_speeds = _plan_speeds(model.plan_speeds, groups, seconds.shape)
        warm = bool(info["warm"])
        own = ~synced if (~synced).any() else np.ones(len(synced), dtype=bool)
        self.steps.append(
            {
                **info,
                "model": model_id,
                "measured": seconds[:, own].sum(axis=1).tolist(),
                "predicted": (plan_cost[:, own] / plan_speeds[:, own]).sum(axis=1).tolist(),
                "ranks": [float(x) for x in rank_seconds],
            }
        )
        for r in range(seconds.shape[0]):
            for m in range(seconds.shape[1]):
                out = warm or bool(synced[m])
                g = (r, 1) if groups is None else (int(groups[r, m, 0]), int(groups[r, m, 1]))
                self.mb.append([model_id, r, float(seconds[r, m]), float(units[r, m]), serial, out, m, *g])
                piece_sizes = tuple(int(x) for x in sizes[r][m])
                self.samples.append((serial, r, int(cps[r, m]), piece_sizes, float(seconds[r, m]), out, g))

    def evidence(self) -> Samples:
        """The refit's samples: the buffer without warm-up micro-batches and without zero times."""
        rows = [s for s in self.samples if not s[5] and s[4] > 0]
        return Samples(
            [np.array(s[3], dtype=np.int64) for s in rows],
            np.array([s[2] for s in rows], dtype=np.int64),
            np.array([s[1] for s in rows], dtype=np.int64),
            np.array([s[4] for s in rows], dtype=np.float64),
            np.array([s[0] for s in rows], dtype=np.int64),
            group=np.array([s[6] for s in rows], dtype=np.int64).reshape(-1, 2) if self.dynamic(rows) else None,
        )

    @staticmethod
    def dynamic(rows: list) -> bool:
        """Whether any of these samples ran in a CP group of several pool ranks (dynamic CP)."""
        return any(s[6][1] > 1 for s in rows)

    def state_dict(self) -> dict:
        """The last STATE_STEPS steps of the report's records and the whole refit buffer (bounded)."""
        first = max(0, len(self.steps) - STATE_STEPS)
        mb = [row[:4] + [row[4] - first] + row[5:] for row in self.mb if row[4] >= first]
        samples = [[s[0] - first, s[1], s[2], list(s[3]), s[4], s[5], list(s[6])] for s in self.samples]
        return {"steps": self.steps[first:], "mb": mb, "samples": samples, "dropped": first}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`; rows saved before groups were kept (7 columns, 6 fields) get (replica, 1)."""
        self.steps = [dict(s) for s in state["steps"]]
        self.mb = [list(x) if len(x) > 7 else [*x, x[1], 1] for x in state["mb"]]
        self.samples = deque(
            ((int(s[0]), int(s[1]), int(s[2]), tuple(int(x) for x in s[3]), float(s[4]), bool(s[5]),
              (int(s[6][0]), int(s[6][1])) if len(s) > 6 else (int(s[1]), 1)) for s in state["samples"]),
            maxlen=self.max_samples,
        )  # fmt: skip


def _plan_speeds(speeds, groups, shape: tuple) -> np.ndarray:
    """[dp, M] the planned speed each micro-batch ran at: its replica's, or (dynamic CP) its group's slowest
    member's; ones without planned speeds."""
    if speeds is None:
        return np.ones(shape)
    speeds = np.asarray(speeds, dtype=np.float64)
    if groups is None:
        return np.repeat(speeds[:, None], shape[1], axis=1)
    return group_speeds(speeds, groups[..., 0].ravel(), groups[..., 1].ravel()).reshape(shape)


def slowest_of_groups(seconds: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """[pool, M] seconds with every rank's entry replaced by the slowest member's of its group in that slot."""
    out = seconds.copy()
    for m in range(seconds.shape[1]):
        for start, size in {(int(a), int(b)) for a, b in groups[:, m]}:
            out[start : start + size, m] = seconds[start : start + size, m].max()
    return out
