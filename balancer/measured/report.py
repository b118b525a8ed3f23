"""`BalanceMonitor.report()`: the measured balance of the steps so far, from the monitor's ledger (the same on every
rank). Warm-up steps are left out of every figure; outlier micro-batches (balancer.measured.refit.OUTLIER_RULE)
are left out of the prediction errors and the fits but not of the measured times (they were real).

- `measured_imbalance`: mean over steps of (slowest replica's measured step time / the replicas' mean);
- `predicted_imbalance`: the same for the plan's prediction (section-3 costs, divided by the speeds the plan had);
- `prediction_error_median` / `_p90`: |measured - predicted| / measured per micro-batch, each under the model its
  window was planned with: a fitted model in seconds (with its fitted replica speeds), the sampler's own model at
  its best single scale (the median of measured / predicted: its units are unknown, FLOPs for `from_config`);
- `idle_fraction`: rank-seconds spent waiting for the step's slowest rank / all rank-seconds (compute only);
- `rank_speeds`, `cost`: the last accepted fit (None / the sampler's model before the first one);
- `fresh_error_median` / `_p90`: the last accepted fit on the micro-batches measured after it (none of them in it).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from balancer.measured.refit import OUTLIER_RULE, outlier_mask, predict, relative_errors, sample_speeds
from balancer.planning.speeds import token_bound

if TYPE_CHECKING:
    from balancer.measured.monitor import BalanceMonitor
    from balancer.planning.topology import Topology

MAX_LISTED = 20  # outliers listed one by one in the report (all are counted)
MAX_SERIES = 2000  # steps of per-replica series kept for the picture


def _errors(mb: np.ndarray, models: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(relative errors of the inliers, outlier mask, predicted seconds) of the micro-batch rows [model, replica,
    measured, units, serial, left out, m, group start, group size]."""
    pred = np.zeros(len(mb))
    out = np.zeros(len(mb), dtype=bool)
    for k, model in enumerate(models):
        mine = mb[:, 0] == k
        if not mine.any():
            continue
        speeds = np.ones(int(mb[:, 7:9].sum(axis=1).max())) if model.speeds is None else np.asarray(model.speeds)
        p = mb[mine, 3] / sample_speeds(speeds, mb[mine, 1].astype(int), mb[mine, 7:9].astype(int))
        if not model.in_seconds:
            p = p * float(np.median(mb[mine, 2] / p))
        pred[mine] = p
        out[mine] = outlier_mask(mb[mine, 2], p, mb[mine, 1])  # each model's own bias per replica
    return relative_errors(mb[~out, 2], pred[~out]), out, pred


def _quantiles(e: np.ndarray) -> tuple:
    return (float(np.median(e)), float(np.quantile(e, 0.9))) if len(e) else (math.nan, math.nan)


def build_report(monitor: BalanceMonitor) -> dict:
    led = monitor.ledger
    steps = measured_steps(led.steps)
    mb = np.array(timed_rows(led.mb), dtype=np.float64).reshape(-1, 9)
    dp, world = led.dp, monitor.world
    meas = np.array([s["measured"] for s in steps], dtype=np.float64).reshape(len(steps), dp)
    pred = np.array([s["predicted"] for s in steps], dtype=np.float64).reshape(len(steps), dp)
    ranks = np.array([s["ranks"] for s in steps], dtype=np.float64).reshape(len(steps), world)
    e, out, mb_pred = _errors(mb, monitor.models)
    fitted = _last_fit(monitor)
    per_model = []
    for k, model in enumerate(monitor.models):
        mine = mb[:, 0] == k
        ek = relative_errors(mb[mine & ~out, 2], mb_pred[mine & ~out])
        per_model.append({"model": k, "from": list(model.start), "fitted": model.in_seconds,
                          "micro_batches": int(mine.sum()), "prediction_error_median": _quantiles(ek)[0],
                          "prediction_error_p90": _quantiles(ek)[1]})  # fmt: skip
    listed = [
        {"epoch": int(led.steps[int(r[4])]["epoch"]), "step": int(led.steps[int(r[4])]["step"]),
         "replica": int(r[1]), "micro_batch": int(r[6]), "seconds": float(r[2]), "predicted": float(p)}
        for r, p in zip(mb[out][:MAX_LISTED], mb_pred[out][:MAX_LISTED])
    ]  # fmt: skip
    return {
        "mode": monitor.mode,
        "steps": len(led.steps),
        "warmup_steps": len(led.steps) - len(steps),
        **headline(monitor, meas, pred, ranks, e),
        "token_bound": _token_bound(monitor, fitted),
        "cost": (fitted or monitor.models[0]).cost.to_dict(),
        "outliers": {"rule": OUTLIER_RULE, "count": int(out.sum()), "micro_batches": listed},
        "models": per_model,
        "refits": list(monitor.refits),
        "monitor_cpu_seconds": monitor.cpu_seconds,
        "refit_cpu_seconds": monitor.refit_seconds,
        "series": {
            "step": [[s["epoch"], s["step"]] for s in steps[-MAX_SERIES:]],
            "window": [s["window"] for s in steps[-MAX_SERIES:]],
            "measured": meas[-MAX_SERIES:].tolist(),
            "predicted": pred[-MAX_SERIES:].tolist(),
        },
    }


def headline(
    monitor: BalanceMonitor, meas: np.ndarray, pred: np.ndarray, ranks: np.ndarray, errors: np.ndarray
) -> dict:
    """The report's headline figures (the ones training logs show) from the measured and predicted step times
    [steps, dp], each rank's own time [steps, world] and the micro-batches' relative errors."""
    med, p90 = _quantiles(errors)
    fitted = _last_fit(monitor)
    fresh = _fresh_errors(monitor, fitted)
    total = ranks.max(axis=1, keepdims=True) if len(ranks) else np.zeros((0, 1))
    idle = float((total - ranks).sum() / (total.sum() * ranks.shape[1])) if len(ranks) and total.sum() > 0 else 0.0
    return {
        "measured_imbalance": _imbalance(meas),
        "predicted_imbalance": _imbalance(pred),
        "prediction_error_median": med,
        "prediction_error_p90": p90,
        "fresh_error_median": fresh[0],
        "fresh_error_p90": fresh[1],
        "idle_fraction": idle,
        "mean_step_seconds": float(meas.max(axis=1).mean()) if len(meas) else math.nan,
        "rank_speeds": None if fitted is None or fitted.speeds is None else list(fitted.speeds),
    }


def measured_steps(steps: list) -> list:
    """The ledger's step records the figures count: those after the warm-up."""
    return [s for s in steps if not s["warm"]]


def timed_rows(rows: list) -> list:
    """The ledger's micro-batch rows the errors count: timed (seconds > 0), neither warm-up nor synced."""
    return [row for row in rows if not row[5] and row[2] > 0]


def _last_fit(monitor):
    """The last accepted fit (a model in seconds), or None."""
    return next((m for m in reversed(monitor.models) if m.in_seconds), None)


def _imbalance(times: np.ndarray) -> float:
    if not len(times):
        return math.nan
    mean = times.mean(axis=1)
    ok = mean > 0
    return float((times.max(axis=1)[ok] / mean[ok]).mean()) if ok.any() else math.nan


def _fresh_errors(monitor, fitted) -> tuple:
    """The last fit's errors on evidence measured after it (steps gathered after the fit was applied)."""
    if fitted is None:
        return math.nan, math.nan
    rows = [s for s in monitor.ledger.samples if not s[5] and s[4] > 0 and s[0] >= fitted.fresh_from]
    if not rows:
        return math.nan, math.nan
    seconds, p = np.array([s[4] for s in rows]), sample_predictions(monitor, fitted, rows)
    keep = ~outlier_mask(seconds, p, np.array([s[1] for s in rows]))
    return _quantiles(relative_errors(seconds[keep], p[keep]))


def sample_predictions(monitor: BalanceMonitor, model: Any, rows: list) -> np.ndarray:
    """Predicted seconds of the ledger's evidence rows `rows` ((serial, unit, cp, sizes, seconds, left out, group))
    under `model` (a fit in seconds): the layout's slowest rank over the unit's fitted speed, a dynamic CP group's
    slowest member's."""
    sizes = [np.array(s[3], dtype=np.int64) for s in rows]
    speeds = np.ones(monitor.ledger.dp) if model.speeds is None else np.asarray(model.speeds)
    group = np.array([s[6] for s in rows], dtype=np.int64)
    p = predict(model.cost, sizes, np.array([s[2] for s in rows]), monitor.layout)
    return p / sample_speeds(speeds, np.array([s[1] for s in rows]), group)


def _token_bound(monitor, fitted) -> dict | None:
    """What the fitted speeds ask of the fastest replica when it cannot hold its share of a step's tokens (None:
    it can, or no fitted speeds): a step budget without that slack caps what planning by speed gains."""
    bound = token_room(monitor.topology, None if fitted is None else fitted.speeds)
    if bound is None:
        return None
    return {"tokens_asked": bound[0], "tokens_held": bound[1], "tokens_per_step_with_room": bound[2]}


def token_room(topology: Topology, speeds: Optional[Sequence[float]]) -> tuple[int, int, int] | None:
    """`balancer.planning.speeds.token_bound` of `topology` with `speeds` (None: no speeds)."""
    return None if speeds is None else token_bound(dataclasses.replace(topology, rank_speeds=tuple(speeds)))
