"""Calibration: time a real model on a grid of packed micro-batches, fit a CostModel, judge it on unseen ones.

    from balancer.calibration import calibrate
    result = calibrate(TINY_LLAMA, cp_sizes=(1, 2), budgets=(1024, 2048, 4096))
    result.cost.save("cost.json")            # or result.save("cost.json"): the model plus the report
    result.report["held_out"]["median_abs_error"]

The held-out split is drawn over micro-batches (balancer.calibration.split): a held-out micro-batch is timed at
every CP size and layout, and none of those timings reaches the fit. See docs/cost-model.md for the grid, the fit,
the fresh-batch check and the errors measured on this project's machines.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from balancer.calibration.clock import CLOCKS, choose_clock, quietness
from balancer.calibration.grid import KINDS, calibration_grid, fresh_budgets, fresh_micro_batches
from balancer.calibration.report import (
    TARGETS,
    by_config,
    error_summary,
    fit_samples,
    predict_samples,
    remedy,
    split_errors,
    target_misses,
)
from balancer.calibration.split import split_by_micro_batch
from balancer.calibration.timing import TINY_LLAMA, time_micro_batches
from balancer.planning.cost.model import CostModel

log = logging.getLogger(__name__)
__all__ = ["CLOCKS", "Calibration", "calibrate", "error_summary"]
DEFAULTS: dict[str, Any] = dict(
    budgets=(4096, 8192), per_cell=4, repeats=3, max_repeats=12, splits=8, fresh_per_budget=2
)


@dataclass
class Calibration:
    """A fitted `cost`, the timed `samples` (dicts: kind, lengths, cp, layout, seconds, wall, cpu, micro_batch,
    held_out, fresh, predicted) and the `report`."""

    cost: CostModel
    samples: list[dict]
    report: dict = field(default_factory=dict)

    def save(self, path: str | os.PathLike) -> None:
        """Write the cost model with the report (samples included) to JSON; `CostModel.load` reads it back."""
        self.cost.save(path, **self.report, samples=self.samples)


def _layouts(layouts) -> list[str]:
    from attention.geometry import KINDS as LAYOUT_KINDS

    for kind in layouts:
        if kind not in LAYOUT_KINDS:
            raise ValueError(f"--layout {kind!r} is not a CP layout of this build ({', '.join(LAYOUT_KINDS)})")
    if not layouts:
        raise ValueError("--layout: give at least one CP layout")
    return list(layouts)


def _check(cp_sizes, budgets, repeats, max_repeats, held_out, split_threshold, splits, fresh_per_budget) -> None:
    if not cp_sizes or any(int(c) != c or c < 1 for c in cp_sizes):
        raise ValueError(f"--cp must list positive CP sizes, got {list(cp_sizes)}")
    if not budgets or any(int(b) != b or b < 16 for b in budgets):
        raise ValueError(f"--tokens must list token budgets >= 16, got {list(budgets)}")
    if int(repeats) != repeats or repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    if int(max_repeats) != max_repeats or max_repeats < repeats:
        raise ValueError(f"--max-repeats must be an integer >= --repeats ({repeats}), got {max_repeats}")
    if not 0 < held_out < 1:
        raise ValueError(f"--held-out must be a fraction between 0 and 1, got {held_out}")
    if split_threshold is not None and split_threshold < 1:
        raise ValueError(f"--split-threshold must be >= 1 token, got {split_threshold}")
    if int(splits) != splits or splits < 1:
        raise ValueError(f"--splits must be >= 1, got {splits}")
    if int(fresh_per_budget) != fresh_per_budget or fresh_per_budget < 0:
        raise ValueError(f"--fresh must be >= 0 micro-batches per budget, got {fresh_per_budget}")


def _check_enough(grid, held: np.ndarray, configs: int, cp_sizes) -> None:
    terms = 4 + 2 * any(cp > 1 for cp in cp_sizes)  # attention, linear, fixed, piece (+ comm, latency)
    train = int((~held).sum()) * configs
    if train < terms + 1:
        raise ValueError(
            f"too few micro-batches to fit {terms} terms: the grid gives {len(grid)} micro-batches, "
            f"{int((~held).sum())} after --held-out ({train} timed samples), at least {terms + 1} samples are needed "
            "for the fit; raise --per-cell or add --tokens budgets"
        )


def calibrate(
    config: dict | None = None,
    *,
    cp_sizes: Sequence[int] = (1, 2),
    layouts: Sequence[str] = ("zigzag", "hybrid"),
    method: str = "ring",
    budgets: Sequence[int] = DEFAULTS["budgets"],
    kinds: Sequence[str] = KINDS,
    per_cell: int = DEFAULTS["per_cell"],
    repeats: int = DEFAULTS["repeats"],
    max_repeats: int = DEFAULTS["max_repeats"],
    threads: int = 1,
    held_out: float = 0.25,
    splits: int = DEFAULTS["splits"],
    fresh_per_budget: int = DEFAULTS["fresh_per_budget"],
    seed: int = 0,
    split_threshold: int | None = None,
    window: int | None = None,
    clock: str = "auto",
    progress: bool | str | None = False,
) -> Calibration:
    """Time `config`'s model (default: a tiny Llama) on `calibration_grid(budgets, kinds, per_cell)` and on
    `fresh_per_budget` fresh micro-batches per budget of `fresh_budgets(budgets)`, every CP size (CP > 1: every
    layout), in a seeded shuffled order: `repeats` times each, then again until the two fastest runs agree within
    2% (`max_repeats` runs at most); the minimum is kept (the least disturbed run).

    The saved model is fitted (`CostModel.fit`, every term) on the grid micro-batches outside the held-out split of
    `seed`; the report gives its error on that split's held-out micro-batches, the held-out error of `splits` splits
    (seeds `seed`, `seed + 1`, ...; each judged with its own fit), the error on the fresh micro-batches, and
    `warnings` when the targets (median <= 5%, p90 <= 10%) are missed. `clock` "auto" fits wall time on a quiet
    machine and process CPU time otherwise (balancer.calibration.clock; the reason is in the report)."""
    if clock not in CLOCKS:
        raise ValueError(f"--clock must be one of {CLOCKS}, got {clock!r}")
    config = dict(TINY_LLAMA if config is None else config)
    _check(cp_sizes, budgets, repeats, max_repeats, held_out, split_threshold, splits, fresh_per_budget)
    layouts = _layouts(layouts)
    grid = calibration_grid(budgets, kinds, per_cell, seed)
    held = split_by_micro_batch(grid, held_out, seed)
    configs = [(int(cp), kind) for cp in cp_sizes for kind in (layouts if cp > 1 else ["zigzag"])]
    _check_enough(grid, held, len(configs), cp_sizes)
    fresh = fresh_micro_batches(fresh_budgets(budgets), fresh_per_budget, seed)
    options = {"split_threshold": split_threshold} if split_threshold is not None else {}
    jobs = [
        {"kind": k, "lengths": lengths, "cp": cp, "layout": kind, "options": options if kind == "hybrid" else {}}
        | {"micro_batch": i, "held_out": bool(i < len(grid) and held[i]), "fresh": i >= len(grid)}
        for cp, kind in configs
        for i, (k, lengths) in enumerate(grid + fresh)
    ]
    load_before, t0 = os.getloadavg(), time.perf_counter()
    timing = dict(method=method, repeats=repeats, max_repeats=max_repeats, threads=threads, progress=progress)
    samples = _timed(config, jobs, seed, settle_on="wall" if clock == "wall" else "cpu", **timing)
    facts = quietness(samples, load_before)
    facts.update(loadavg_before=list(load_before), loadavg_after=list(os.getloadavg()))
    chosen, reason = choose_clock(clock, facts)
    for s in samples:
        s["seconds"] = min(s[chosen])
    settings = dict(
        clock=chosen,
        clock_reason=reason,
        machine=facts,
        repeats=repeats,
        max_repeats=max_repeats,
        runs_per_micro_batch=float(np.mean([len(s["cpu"]) for s in samples])),
        per_cell=per_cell,
        budgets=[int(b) for b in budgets],
        threads=threads,
        timing_seconds=time.perf_counter() - t0,
    )
    if window is None:
        window = CostModel.from_config({k: v for k, v in config.items() if k != "model_type"}).window
    seeds = range(seed, seed + splits)
    result = _fit_and_report(samples, grid, held_out, seeds, window, method, options)
    result.report.update(model_config=config, **settings)
    misses = target_misses(result.report)
    result.report["meets_targets"] = not misses
    result.report["warnings"] = (
        [f"the fit misses its targets: {'; '.join(misses)}. Remedy: {remedy(result.report)}"] if misses else []
    )
    return result


def _timed(config: dict, jobs: list[dict], seed: int, **timing) -> list[dict]:
    """The jobs as samples with their runs' `wall` and `cpu` seconds, timed in a seeded shuffled order (so that a
    change of load during the run does not line up with a CP size or a budget)."""
    order = np.random.default_rng([seed, 1]).permutation(len(jobs))
    timed = time_micro_batches(config, [jobs[i] for i in order], **timing)
    runs = {int(i): reps for i, reps in zip(order, timed)}
    return [{**job, "wall": [r[0] for r in runs[i]], "cpu": [r[1] for r in runs[i]]} for i, job in enumerate(jobs)]


def _fit_and_report(samples, grid, held_out, seeds, window, method, options) -> Calibration:
    grid_samples = [s for s in samples if not s["fresh"]]
    train = [s for s in grid_samples if not s["held_out"]]
    cost = fit_samples(train, window, method, options)
    for s, p in zip(samples, predict_samples(cost, samples, method)):
        s["predicted"] = p
    test = [s for s in grid_samples if s["held_out"]]
    fresh = [s for s in samples if s["fresh"]]
    report = {
        "method": method,
        "layout_options": options,
        "split": {"by": "micro-batch", "held_out": held_out, "seed": seeds[0], "micro_batches": len(grid)},
        "targets": TARGETS,
        "train": error_summary([s["predicted"] for s in train], [s["seconds"] for s in train]),
        "held_out": error_summary([s["predicted"] for s in test], [s["seconds"] for s in test]),
        **by_config(test, "held_out"),
        "splits": split_errors(grid_samples, grid, held_out, seeds, window, method, options),
        "fresh": error_summary([s["predicted"] for s in fresh], [s["seconds"] for s in fresh]),
        **by_config(fresh, "fresh"),
    }
    report["split"]["held_out_micro_batches"] = len({s["micro_batch"] for s in test})
    log.info("calibration: held-out median |error| %.1f%%", 100 * report["held_out"].get("median_abs_error", 0))
    return Calibration(cost, samples, report)
