"""Calibration: time a real model on a grid of packed micro-batches, fit a CostModel, report held-out error.

    from balancer.calibration import calibrate
    result = calibrate(TINY_LLAMA, cp_sizes=(1, 2), budgets=(1024, 2048, 4096))
    result.cost.save("cost.json")            # or result.save("cost.json"): the model plus the report
    result.report["held_out"]["median_abs_error"]

See docs/cost-model.md for the grid, the fit and the errors measured on this project's machines.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import numpy as np

from balancer.calibration.grid import KINDS, calibration_grid
from balancer.calibration.timing import TINY_LLAMA, time_micro_batches
from balancer.planning.cost import CostModel

log = logging.getLogger(__name__)
CLOCKS = ("cpu", "wall")


@dataclass
class Calibration:
    """A fitted `cost`, the timed `samples` (dicts: kind, lengths, cp, layout, seconds, held_out) and `report`."""

    cost: CostModel
    samples: list[dict]
    report: dict = field(default_factory=dict)

    def save(self, path) -> None:
        """Write the cost model with the report (samples included) to JSON; `CostModel.load` reads it back."""
        self.cost.save(path, **self.report, samples=self.samples)


def error_summary(predicted, measured) -> dict:
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


def _layouts(layouts, cp_sizes) -> list[str]:
    from attention.layout import KINDS as LAYOUT_KINDS

    chosen = []
    for kind in layouts:
        if kind not in LAYOUT_KINDS:
            raise ValueError(f"--layout {kind!r} is not a CP layout of this build ({', '.join(LAYOUT_KINDS)})")
        chosen.append(kind)
    if not chosen:
        raise ValueError("--layout: give at least one CP layout")
    return chosen


def _check(cp_sizes, budgets, repeats, held_out, split_threshold) -> None:
    if not cp_sizes or any(int(c) != c or c < 1 for c in cp_sizes):
        raise ValueError(f"--cp must list positive CP sizes, got {list(cp_sizes)}")
    if not budgets or any(int(b) != b or b < 16 for b in budgets):
        raise ValueError(f"--tokens must list token budgets >= 16, got {list(budgets)}")
    if int(repeats) != repeats or repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    if not 0 < held_out < 1:
        raise ValueError(f"--held-out must be a fraction between 0 and 1, got {held_out}")
    if split_threshold is not None and split_threshold < 1:
        raise ValueError(f"--split-threshold must be >= 1 token, got {split_threshold}")


def _check_enough(count: int, held_out: float, cp_sizes) -> None:
    terms = 4 + 2 * any(cp > 1 for cp in cp_sizes)  # attention, linear, fixed, piece (+ comm, latency)
    train = count - int(np.ceil(held_out * count))
    if train < terms + 1:
        raise ValueError(
            f"too few micro-batches to fit {terms} terms: the grid gives {count} ({train} after --held-out "
            f"{held_out}), at least {terms + 1} are needed for the fit; raise --per-cell or add --tokens budgets"
        )


def calibrate(
    config: dict | None = None,
    *,
    cp_sizes=(1, 2),
    layouts=("zigzag", "hybrid"),
    method: str = "ring",
    budgets=(2048, 4096, 8192),
    kinds=KINDS,
    per_cell: int = 2,
    repeats: int = 3,
    threads: int = 1,
    held_out: float = 0.25,
    seed: int = 0,
    split_threshold: int | None = None,
    window: int | None = None,
    clock: str = "cpu",
    progress: bool = False,
) -> Calibration:
    """Time `config`'s model (default: a tiny Llama) on `calibration_grid(budgets, kinds, per_cell)` for every CP
        size (CP > 1: every layout), fit all terms (`CostModel.fit`) on the samples not held out, report the error on
        the held-out ones. A sample's time is the minimum over `repeats` (the least disturbed by other jobs) of the
    `clock`: "cpu" (process CPU time, the slowest rank's; robust on a shared machine) or "wall"."""
    if clock not in CLOCKS:
        raise ValueError(f"--clock must be one of {CLOCKS}, got {clock!r}")
    config = dict(TINY_LLAMA if config is None else config)
    _check(cp_sizes, budgets, repeats, held_out, split_threshold)
    layouts = _layouts(layouts, cp_sizes)
    grid = calibration_grid(budgets, kinds, per_cell, seed)
    _check_enough(len(grid) * sum(len(layouts) if cp > 1 else 1 for cp in cp_sizes), held_out, cp_sizes)
    options = {"split_threshold": split_threshold} if split_threshold is not None else {}
    load_before = os.getloadavg()
    jobs = [
        {"kind": k, "lengths": lengths, "cp": int(cp), "layout": kind, "options": options if kind == "hybrid" else {}}
        for cp in cp_sizes
        for kind in (layouts if cp > 1 else ["zigzag"])
        for k, lengths in grid
    ]
    times = time_micro_batches(config, jobs, method=method, repeats=repeats, threads=threads, progress=progress)
    samples = []
    for job, reps in zip(jobs, times):
        wall, cpu = [r[0] for r in reps], [r[1] for r in reps]
        samples.append({**job, "seconds": min(cpu) if clock == "cpu" else min(wall), "wall": wall, "cpu": cpu})
    rng = np.random.default_rng(seed)
    held = rng.random(len(samples)) < held_out
    if held.all() or not held.any():
        held = np.arange(len(samples)) % max(2, round(1 / held_out)) == 0
    for s, h in zip(samples, held):
        s["held_out"] = bool(h)
    report = _fit_and_report(samples, config, method, window, options)
    report.report.update(
        clock=clock,
        repeats=repeats,
        threads=threads,
        loadavg_before=list(load_before),
        loadavg_after=list(os.getloadavg()),
    )
    return report


def _fit_and_report(samples, config, method, window, options) -> Calibration:
    train = [s for s in samples if not s["held_out"]]
    test = [s for s in samples if s["held_out"]]
    if window is None:
        window = CostModel.from_config({k: v for k, v in config.items() if k != "model_type"}).window
    fit_comm = any(s["cp"] > 1 for s in train)
    cost = CostModel.fit(
        [s["lengths"] for s in train],
        [s["seconds"] for s in train],
        window=window,
        cp=[s["cp"] for s in train],
        layout=[s["layout"] for s in train],
        method=method,
        fit_pieces=True,
        fit_comm=fit_comm,
        layout_options=options,
    )
    from balancer.planning.predict import micro_batch_time

    for s in samples:
        opts = s["options"]
        s["predicted"] = micro_batch_time(cost, s["lengths"], s["cp"], s["layout"], method, **opts)
    report = {
        "model_config": config,
        "method": method,
        "layout_options": options,
        "train": error_summary([s["predicted"] for s in train], [s["seconds"] for s in train]),
        "held_out": error_summary([s["predicted"] for s in test], [s["seconds"] for s in test]),
    }
    for cp in sorted({s["cp"] for s in samples}):
        for kind in sorted({s["layout"] for s in samples if s["cp"] == cp}):
            part = [s for s in test if s["cp"] == cp and s["layout"] == kind]
            report[f"held_out_cp{cp}_{kind}"] = error_summary(
                [s["predicted"] for s in part], [s["seconds"] for s in part]
            )
    log.info("calibration: held-out median |error| %.1f%%", 100 * report["held_out"].get("median_abs_error", 0))
    return Calibration(cost, samples, report)
