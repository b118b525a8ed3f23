"""What the monitor keeps of the measured steps: per step the measured and predicted time of every replica and every
rank's compute seconds; per micro-batch the measured and predicted seconds (for the prediction errors); and a
bounded buffer of micro-batch compositions with their times (the refit's evidence). Everything here is built from
the gathered measurements and the plan alone, so it is the same on every rank."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from balancer.measured.refit import Samples, predict
from balancer.planning.cost.model import CostModel

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
    mb: list = field(default_factory=list)  # [model, replica, measured, predicted units, serial, left out, m]
    samples: deque = None  # (serial, replica, cp, sizes, seconds, left out: warm-up or synced)

    def __post_init__(self) -> None:
        if self.samples is None:
            self.samples = deque(maxlen=self.max_samples)

    def add_step(self, info: dict, model_id: int, model: Model, sizes: list, cp: int, seconds, rank_seconds, synced):
        """One gathered step: `sizes[r][m]` the piece sizes of replica r's micro-batch m, `seconds` [dp, M] the
        slowest rank of each replica, `rank_seconds` [ranks] each rank's compute, `synced` [M] micro-batches whose
        time includes the gradient reduction (left out of the step times, the errors and the fit)."""
        serial = len(self.steps)
        seconds = np.asarray(seconds, dtype=np.float64)
        flat = [s for per in sizes for s in per]
        units = predict(model.cost, flat, np.full(len(flat), cp), self.layout).reshape(seconds.shape)
        plan_cost = np.array([[model.cost.micro_batch_cost(s) / cp for s in per] for per in sizes])
        plan_speeds = np.ones(self.dp) if model.plan_speeds is None else np.asarray(model.plan_speeds)
        warm = bool(info["warm"])
        own = ~synced if (~synced).any() else np.ones(len(synced), dtype=bool)
        self.steps.append(
            {
                **info,
                "model": model_id,
                "measured": seconds[:, own].sum(axis=1).tolist(),
                "predicted": (plan_cost[:, own].sum(axis=1) / plan_speeds).tolist(),
                "ranks": [float(x) for x in rank_seconds],
            }
        )
        for r in range(seconds.shape[0]):
            for m in range(seconds.shape[1]):
                out = warm or bool(synced[m])
                self.mb.append([model_id, r, float(seconds[r, m]), float(units[r, m]), serial, out, m])
                self.samples.append((serial, r, cp, tuple(int(x) for x in sizes[r][m]), float(seconds[r, m]), out))

    def evidence(self) -> Samples:
        """The refit's samples: the buffer without warm-up micro-batches and without zero times."""
        rows = [s for s in self.samples if not s[5] and s[4] > 0]
        return Samples(
            [np.array(s[3], dtype=np.int64) for s in rows],
            np.array([s[2] for s in rows], dtype=np.int64),
            np.array([s[1] for s in rows], dtype=np.int64),
            np.array([s[4] for s in rows], dtype=np.float64),
            np.array([s[0] for s in rows], dtype=np.int64),
        )

    def state_dict(self) -> dict:
        """The last STATE_STEPS steps of the report's records and the whole refit buffer (bounded)."""
        first = max(0, len(self.steps) - STATE_STEPS)
        mb = [row[:4] + [row[4] - first] + row[5:] for row in self.mb if row[4] >= first]
        samples = [[s[0] - first, s[1], s[2], list(s[3]), s[4], s[5]] for s in self.samples]
        return {"steps": self.steps[first:], "mb": mb, "samples": samples, "dropped": first}

    def load_state_dict(self, state: dict) -> None:
        self.steps = [dict(s) for s in state["steps"]]
        self.mb = [list(x) for x in state["mb"]]
        self.samples = deque(
            ((int(s[0]), int(s[1]), int(s[2]), tuple(int(x) for x in s[3]), float(s[4]), bool(s[5])) for s in
             state["samples"]), maxlen=self.max_samples,
        )  # fmt: skip
