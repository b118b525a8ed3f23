"""Fitting timed micro-batches and judging the fit: held-out splits by micro-batch, fresh micro-batches, targets.

Every figure here comes from a model that did not see the micro-batches it is judged on: the held-out error of a
split is measured with the model fitted on that split's other micro-batches, the fresh error with the saved model
(fitted on the first split), on micro-batches of another length distribution and other budgets than the grid's,
timed after the fit. Held-out micro-batches are judged against `TARGETS` (median <= 5%, p90 <= 10%), fresh ones,
which also carry the noise of a second timing on a machine whose load may have changed, against `FRESH_TARGETS`
(median <= 10%, p90 <= 20%).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
from numpy.typing import ArrayLike

from balancer.calibration.split import split_by_micro_batch
from balancer.planning.cost.fit import fit_cost_model
from balancer.planning.cost.model import CostModel

TARGETS = {"median_abs_error": 0.05, "p90_abs_error": 0.10}
FRESH_TARGETS = {"median_abs_error": 0.10, "p90_abs_error": 0.20}


def error_summary(predicted: ArrayLike, measured: ArrayLike) -> dict:
    """Relative errors `predicted / measured - 1`: median and 90th percentile of their absolute value, max, bias."""
    rel = np.asarray(predicted, dtype=np.float64) / np.asarray(measured, dtype=np.float64) - 1.0
    if rel.size == 0:
        return {"count": 0}
    return {
        "count": int(rel.size),
        "median_abs_error": float(np.median(np.abs(rel))),
        "p90_abs_error": float(np.percentile(np.abs(rel), 90)),
        "max_abs_error": float(np.max(np.abs(rel))),
        "mean_error": float(np.mean(rel)),
    }


def fresh_check(predicted: ArrayLike, measured: ArrayLike) -> dict:
    """`error_summary` of fresh micro-batches with the verdict against `FRESH_TARGETS`: `meets_targets` when the
    median |error| and the p90 are both within theirs (False for no micro-batches)."""
    out = error_summary(predicted, measured)
    out["meets_targets"] = bool(out["count"]) and all(out[k] <= v for k, v in FRESH_TARGETS.items())
    return out


def fit_samples(train: list[dict], window: int | None, method: str, options: dict, loss: str = "squares") -> CostModel:
    """`CostModel.fit` of every term on these timed samples (communication terms when any has CP > 1), with `loss`
    "squares", "huber" or "trim" (balancer.planning.cost.fit)."""
    return fit_cost_model(
        CostModel,
        [s["lengths"] for s in train],
        [s["seconds"] for s in train],
        causal=True,
        window=window,
        fit_fixed=True,
        fit_pieces=True,
        fit_comm=any(s["cp"] > 1 for s in train),
        cp=[s["cp"] for s in train],
        layout=[s["layout"] for s in train],
        method=method,
        layout_options=options,
        loss=loss,
    )


def predict_samples(cost: CostModel, samples: list[dict], method: str) -> list[float]:
    from balancer.planning.cost.predict import micro_batch_time

    return [micro_batch_time(cost, s["lengths"], s["cp"], s["layout"], method, **s["options"]) for s in samples]


def by_config(samples: list[dict], prefix: str) -> dict:
    """`{prefix}_cp{c}_{layout}`: the error summary of each (CP size, layout) among `samples` (predicted set)."""
    out = {}
    for cp in sorted({s["cp"] for s in samples}):
        for kind in sorted({s["layout"] for s in samples if s["cp"] == cp}):
            part = [s for s in samples if s["cp"] == cp and s["layout"] == kind]
            out[f"{prefix}_cp{cp}_{kind}"] = error_summary([s["predicted"] for s in part], [s["seconds"] for s in part])
    return out


def split_errors(
    grid_samples: list[dict],
    grid: Sequence[tuple[str, Sequence[int]]],
    held_out: float,
    seeds: Iterable[int],
    window: int | None,
    method: str,
    options: dict,
    loss: str = "squares",
) -> dict:
    """Held-out error over several splits by micro-batch: each split's model is fitted on its own fit set and judged
    on its held-out micro-batches. `median_abs_error` is the median over splits of each split's median,
    `worst_p90_abs_error` the largest p90. A split whose fit fails is listed with its error and counts as a miss."""
    per_split: list[dict] = []
    for seed in seeds:
        held = split_by_micro_batch(grid, held_out, int(seed))
        train = [s for s in grid_samples if not held[s["micro_batch"]]]
        test = [s for s in grid_samples if held[s["micro_batch"]]]
        try:
            cost = fit_samples(train, window, method, options, loss)
        except ValueError as e:
            per_split.append({"seed": int(seed), "error": str(e)})
            continue
        summary = error_summary(predict_samples(cost, test, method), [s["seconds"] for s in test])
        per_split.append({"seed": int(seed), "held_out_micro_batches": int(held.sum()), **summary})
    fitted = [s for s in per_split if "error" not in s]
    out = {"count": len(per_split), "failed": len(per_split) - len(fitted), "per_split": per_split}
    if fitted:
        medians = [s["median_abs_error"] for s in fitted]
        p90s = [s["p90_abs_error"] for s in fitted]
        out.update(
            median_abs_error=float(np.median(medians)),
            worst_median_abs_error=float(max(medians)),
            median_p90_abs_error=float(np.median(p90s)),
            worst_p90_abs_error=float(max(p90s)),
        )
    return out


def target_misses(report: dict) -> list[str]:
    """What misses the targets: held-out splits (median <= 5%, p90 <= 10%), fresh micro-batches timed after the
    fit (median <= 10%, p90 <= 20%)."""
    misses = []
    splits, fresh = report.get("splits", {}), report.get("fresh", {})
    if splits.get("failed"):
        misses.append(f"{splits['failed']} of {splits['count']} held-out splits could not be fitted")
    checks = [
        ("held-out median |error| (median over splits)", splits.get("median_abs_error"), TARGETS, "median"),
        ("held-out p90 |error| (worst split)", splits.get("worst_p90_abs_error"), TARGETS, "p90"),
        ("fresh micro-batches median |error|", fresh.get("median_abs_error"), FRESH_TARGETS, "median"),
        ("fresh micro-batches p90 |error|", fresh.get("p90_abs_error"), FRESH_TARGETS, "p90"),
    ]
    for label, value, targets, which in checks:
        target = targets[f"{which}_abs_error"]
        if value is not None and value > target:
            misses.append(f"{label} {100 * value:.1f}% > {100 * target:.0f}%")
    return misses


def remedy(report: dict) -> str:
    """What to change when a fit misses, from the settings and the machine the calibration measured."""
    facts = report.get("machine", {})
    steps = [
        f"raise --max-repeats (now {report.get('max_repeats')}, {report.get('runs_per_micro_batch', 0):.1f} runs per "
        f"micro-batch on average) and --per-cell (now {report.get('per_cell')})",
        f"add larger --tokens budgets (now {report.get('budgets')}; the smallest micro-batches are the noisiest)",
    ]
    if facts.get("load_per_core", 0) > 0.5 or facts.get("wall_over_cpu", 1) > 1.1:
        steps.append(
            f"calibrate when the machine is quieter (load average {facts.get('load_per_core', 0):.2f} per core, "
            f"CP-1 wall/CPU {facts.get('wall_over_cpu', 1):.2f} during this run)"
        )
    return "; ".join(steps)
