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
    FRESH_TARGETS,
    TARGETS,
    by_config,
    error_summary,
    fit_samples,
    fresh_check,
    predict_samples,
    remedy,
    split_errors,
    target_misses,
)
from balancer.calibration.split import split_by_micro_batch
from balancer.calibration.timing import TINY_LLAMA, time_micro_batches
from balancer.planning.cost.fit import LOSSES
from balancer.planning.cost.model import CostModel

log = logging.getLogger(__name__)
__all__ = ["CLOCKS", "Calibration", "calibrate", "error_summary"]
DEFAULTS: dict[str, Any] = dict(
    budgets=(4096, 8192),
    per_cell=4,
    repeats=3,
    max_repeats=12,
    splits=8,
    fresh_per_budget=2,
    statistic="min",
    loss="trim",
)
STATISTICS = ("min", "median")


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
    statistic: str = DEFAULTS["statistic"],
    loss: str = DEFAULTS["loss"],
    spread_runs: bool = True,
    progress: bool | str | None = False,
) -> Calibration:
    """Time `config`'s model (default: a tiny Llama) on `calibration_grid(budgets, kinds, per_cell)`, every CP size
    (CP > 1: every layout), in a seeded shuffled order: `repeats` times each, then again until the two fastest runs
    agree within 2% (`max_repeats` runs at most), in rounds (`spread_runs`, balancer.calibration.timing) or, without
    it, back to back; a micro-batch's time is the `statistic` ("min": the least disturbed run, or "median") of its
    runs.

    The saved model is fitted (`CostModel.fit`, every term, `loss` "squares", "huber" or "trim") on the grid
    micro-batches outside the held-out split of `seed`; the report gives its error on that split's held-out
    micro-batches and the held-out error of `splits` splits (seeds `seed`, `seed + 1`, ...; each judged with its own
    fit). Then, after the fit, `fresh_per_budget` fresh micro-batches per budget of `fresh_budgets(budgets)` are
    timed the same way and predicted by the saved model (`fresh`). `warnings` name the targets missed (held-out:
    median <= 5%, p90 <= 10%; fresh: median <= 10%, p90 <= 20%). `clock` "auto" fits wall time on a quiet machine
    and process CPU time otherwise (balancer.calibration.clock; the reason is in the report)."""
    if clock not in CLOCKS:
        raise ValueError(f"--clock must be one of {CLOCKS}, got {clock!r}")
    if statistic not in STATISTICS:
        raise ValueError(f"--statistic must be one of {STATISTICS}, got {statistic!r}")
    if loss not in LOSSES:
        raise ValueError(f"--loss must be one of {LOSSES}, got {loss!r}")
    config = dict(TINY_LLAMA if config is None else config)
    _check(cp_sizes, budgets, repeats, max_repeats, held_out, split_threshold, splits, fresh_per_budget)
    layouts = _layouts(layouts)
    grid = calibration_grid(budgets, kinds, per_cell, seed)
    held = split_by_micro_batch(grid, held_out, seed)
    configs = [(int(cp), kind) for cp in cp_sizes for kind in (layouts if cp > 1 else ["zigzag"])]
    _check_enough(grid, held, len(configs), cp_sizes)
    fresh = fresh_micro_batches(fresh_budgets(budgets), fresh_per_budget, seed)
    options = {"split_threshold": split_threshold} if split_threshold is not None else {}
    timing = dict(method=method, repeats=repeats, max_repeats=max_repeats, threads=threads, progress=progress)
    timing.update(settle_on="wall" if clock == "wall" else "cpu", spread=spread_runs)
    t0 = time.perf_counter()
    grid_jobs = _jobs(grid, configs, options, held, first=0, fresh=False)
    samples, facts = _timed_phase(config, grid_jobs, seed, timing)
    chosen, reason = choose_clock(clock, facts)
    _set_seconds(samples, chosen, statistic)
    if window is None:
        window = CostModel.from_config({k: v for k, v in config.items() if k != "model_type"}).window
    fit = dict(window=window, method=method, options=options, loss=loss)
    result = _fit_and_report(samples, grid, held_out, range(seed, seed + splits), **fit)
    fresh_jobs = _jobs(fresh, configs, options, None, first=len(grid), fresh=True)
    fresh_samples, fresh_facts = _timed_phase(config, fresh_jobs, seed + 1, timing) if fresh_jobs else ([], {})
    _set_seconds(fresh_samples, chosen, statistic)
    _judge_fresh(result, fresh_samples, method, fresh_facts)
    runs = [len(s["cpu"]) for s in result.samples]
    result.report.update(
        model_config=config, clock=chosen, clock_reason=reason, machine=facts, repeats=repeats,
        max_repeats=max_repeats, runs_per_micro_batch=float(np.mean(runs)), per_cell=per_cell,
        budgets=[int(b) for b in budgets], threads=threads, statistic=statistic, loss=loss, spread_runs=spread_runs,
        timing_seconds=time.perf_counter() - t0,
    )  # fmt: skip
    misses = target_misses(result.report)
    result.report["meets_targets"] = not misses
    result.report["warnings"] = (
        [f"the fit misses its targets: {'; '.join(misses)}. Remedy: {remedy(result.report)}"] if misses else []
    )
    return result


def _jobs(batches, configs, options: dict, held, *, first: int, fresh: bool) -> list[dict]:
    """One timing job per (micro-batch, CP size, layout); micro-batch numbers start at `first`."""
    return [
        {"kind": k, "lengths": lengths, "cp": cp, "layout": kind, "options": options if kind == "hybrid" else {}}
        | {"micro_batch": first + i, "held_out": bool(held is not None and held[i]), "fresh": fresh}
        for cp, kind in configs
        for i, (k, lengths) in enumerate(batches)
    ]


def _timed_phase(config: dict, jobs: list[dict], seed: int, timing: dict) -> tuple[list[dict], dict]:
    """The jobs timed (`_timed`), with the machine's facts while they ran (balancer.calibration.clock)."""
    load_before = os.getloadavg()
    samples = _timed(config, jobs, seed, **timing)
    facts = quietness(samples, load_before)
    facts.update(loadavg_before=list(load_before), loadavg_after=list(os.getloadavg()))
    return samples, facts


def _set_seconds(samples: list[dict], clock: str, statistic: str) -> None:
    """Each sample's `seconds`: the `statistic` of its runs on `clock`."""
    for s in samples:
        s["seconds"] = float(min(s[clock]) if statistic == "min" else np.median(s[clock]))


def _timed(config: dict, jobs: list[dict], seed: int, **timing) -> list[dict]:
    """The jobs as samples with their runs' `wall` and `cpu` seconds, timed in a seeded shuffled order (so that a
    change of load during the run does not line up with a CP size or a budget)."""
    order = np.random.default_rng([seed, 1]).permutation(len(jobs))
    timed = time_micro_batches(config, [jobs[i] for i in order], seed=seed, **timing)
    runs = {int(i): reps for i, reps in zip(order, timed)}
    return [{**job, "wall": [r[0] for r in runs[i]], "cpu": [r[1] for r in runs[i]]} for i, job in enumerate(jobs)]


def _fit_and_report(samples, grid, held_out, seeds, window, method, options, loss="squares") -> Calibration:
    """The saved model (fitted on the first split's fit set), its held-out errors and those of every split."""
    grid_samples = [s for s in samples if not s["fresh"]]
    train = [s for s in grid_samples if not s["held_out"]]
    cost = fit_samples(train, window, method, options, loss)
    for s, p in zip(grid_samples, predict_samples(cost, grid_samples, method)):
        s["predicted"] = p
    test = [s for s in grid_samples if s["held_out"]]
    report = {
        "method": method,
        "layout_options": options,
        "split": {"by": "micro-batch", "held_out": held_out, "seed": seeds[0], "micro_batches": len(grid)},
        "targets": TARGETS,
        "fresh_targets": FRESH_TARGETS,
        "train": error_summary([s["predicted"] for s in train], [s["seconds"] for s in train]),
        "held_out": error_summary([s["predicted"] for s in test], [s["seconds"] for s in test]),
        **by_config(test, "held_out"),
        "splits": split_errors(grid_samples, grid, held_out, seeds, window, method, options, loss),
    }
    report["split"]["held_out_micro_batches"] = len({s["micro_batch"] for s in test})
    log.info("calibration: held-out median |error| %.1f%%", 100 * report["held_out"].get("median_abs_error", 0))
    return Calibration(cost, grid_samples, report)


def _judge_fresh(result: Calibration, fresh: list[dict], method: str, facts: dict) -> None:
    """Predict the fresh micro-batches (timed after the fit) with the saved model; add them and their errors."""
    for s, p in zip(fresh, predict_samples(result.cost, fresh, method)):
        s["predicted"] = p
    result.samples.extend(fresh)
    result.report["fresh"] = fresh_check([s["predicted"] for s in fresh], [s["seconds"] for s in fresh])
    result.report.update(by_config(fresh, "fresh"))
    result.report["fresh_machine"] = facts
