"""Does the calibrated cost model predict fresh micro-batches on this machine, at the load it finds and under load?

Runs `balancer calibrate` with its default settings (balancer.calibration.run.DEFAULTS: a tiny Llama, CP 1 and CP 2
over gloo with one thread per rank, the zigzag and hybrid layouts, the default token budgets, each micro-batch's
runs spread over the timing in rounds) at the load the machine has ("as found") and with two busy loops beside it
(`python -c "while True: pass"`, started and stopped by this script); a third run, with the busy loops, times each
micro-batch's runs back to back (as calibrate did before it spread them): the ablation of the timing order. (A run
with 2 torch threads per rank, `--threads 2`, is left out: on 2 shared cores its grid alone had not finished after
17 minutes.) Each run records what the command reports: the error on fresh micro-batches (other documents, other
budgets, timed after the fit), the held-out error over several splits by micro-batch, the clock and why, the load
before the grid, before the fresh micro-batches and after, and the wall time the calibration took.

The ablation also re-fits each run's own timings several ways (no new timing): how a micro-batch's runs become its
time (min, median, first run only, min of the first 3, min without the first run), the fit's loss (least squares,
Huber, trimmed), the clock, and the fit set (the first split's fit set or the whole grid), each judged on the same
fresh micro-batches (their runs reduced the same way). Writes benchmarks/results/calibration.json (reports,
ablations, every sample) and benchmarks/results/cost_tiny_llama_cpu.json (the "as found" model, read by replay.py).

    python benchmarks/calibration.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's packages, not an installed copy

import _render as tb
from _common import RESULTS, write_result

from balancer.calibration import TINY_LLAMA, calibrate, error_summary
from balancer.calibration.report import fit_samples, predict_samples
from balancer.calibration.run import DEFAULTS
from balancer.cli.calibrate import format_report

COST_FILE = RESULTS / "cost_tiny_llama_cpu.json"
BUSY = "while True: pass"
RUNS = {  # run name -> (busy loops started beside it, runs spread in rounds: the default, torch threads per rank)
    "as found": (0, True, 1),
    "two busy loops": (2, True, 1),
    "two busy loops, runs back to back": (2, False, 1),
}
STATISTICS = {  # how a micro-batch's runs become its time
    "min": lambda runs: min(runs),
    "median": lambda runs: float(np.median(runs)),
    "first run": lambda runs: runs[0],
    "min of first 3": lambda runs: min(runs[:3]),
    "min without first run": lambda runs: min(runs[1:]) if len(runs) > 1 else runs[0],
}
LOSSES = ("squares", "huber", "trim")


def _variant(samples: list[dict], clock: str, stat: str, loss: str, whole_grid: bool, report: dict) -> dict:
    """Re-fit the run's own timings one way; its errors on the held-out micro-batches and on the fresh ones."""
    reduce = STATISTICS[stat]
    timed = [s | {"seconds": float(reduce(s[clock]))} for s in samples]
    grid = [s for s in timed if not s["fresh"]]
    fit_set = grid if whole_grid else [s for s in grid if not s["held_out"]]
    cost = fit_samples(fit_set, None, report["method"], report["layout_options"], loss)
    role = "run's" if clock == report["clock"] else "other"
    out = {
        "clock": clock,
        "clock_role": role,
        "statistic": stat,
        "loss": loss,
        "fit_set": "whole grid" if whole_grid else "split",
    }
    for name, part in (("held_out", [s for s in grid if s["held_out"]]), ("fresh", [s for s in timed if s["fresh"]])):
        predicted = predict_samples(cost, part, report["method"])
        out[name] = error_summary(predicted, [s["seconds"] for s in part])
    return out


def ablation(samples: list[dict], report: dict) -> list[dict]:
    """Every statistic x loss on the run's clock (split fit set), the other clock and the whole grid as fit set for
    the min statistic."""
    clock, other = report["clock"], "wall" if report["clock"] == "cpu" else "cpu"
    variants = [(clock, stat, loss, False) for stat in STATISTICS for loss in LOSSES]
    variants += [(other, "min", loss, False) for loss in LOSSES] + [(clock, "min", loss, True) for loss in LOSSES]
    return [_variant(samples, *v, report) for v in variants]


def run_at(name: str, busy: int, spread: bool, threads: int, settings: dict) -> dict:
    """One calibration with `busy` busy loops running beside it (`spread`: runs in rounds; `threads` per rank; the
    defaults: in rounds, 1 thread)."""
    loops = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(busy)]
    try:
        time.sleep(5 if busy else 0)  # the loops are running before the timing starts
        t0, load = time.perf_counter(), os.getloadavg()
        result = calibrate(TINY_LLAMA, **settings, spread_runs=spread, threads=threads, progress=sys.stderr.isatty())
        seconds = time.perf_counter() - t0
    finally:
        for p in loops:
            p.kill()
            p.wait()
    order = "in rounds" if spread else "back to back"
    print(f"== {name}: load average {load[0]:.1f} at start, {busy} busy loops, runs {order}, {threads} threads")
    print(format_report(result.cost, result.report))
    print(f"calibration took {seconds:.0f} s (wall)")
    return {
        "busy_loops": busy,
        "spread_runs": spread,
        "threads": threads,
        "load_at_start": list(load),
        "seconds": seconds,
        "result": result,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small grid (a test run; results not written)")
    args = ap.parse_args()
    settings = dict(budgets=(1024, 2048), per_cell=2, repeats=1, max_repeats=2, splits=3) if args.quick else {}
    runs = {name: run_at(name, *how, settings) for name, how in RUNS.items()}
    results = {name: run.pop("result") for name, run in runs.items()}
    for name, result in results.items():
        runs[name].update(cost_model=result.cost.to_dict(), report=result.report, samples=result.samples)
        runs[name]["ablation"] = ablation(result.samples, result.report)
    print(table_ablation(runs))
    if args.quick:
        return
    results["as found"].save(COST_FILE)
    settings = {k: list(v) if isinstance(v, tuple) else v for k, v in DEFAULTS.items()}
    # every run is timed on both clocks; each run's report names the one its figures use and why
    path = write_result("calibration", {"settings": settings, "runs": runs}, clock="wall+process_cpu", model=TINY_LLAMA)
    print(f"wrote {path} and {COST_FILE}")


# ---- the tables this benchmark states (rendered into docs/ by benchmarks/tables.py) ----


def _runs() -> dict:
    return tb.load("calibration")["runs"]


def _part_rows(name: str, report: dict) -> list[list[str]]:
    parts = [k for k, v in report.items() if isinstance(v, dict) and "max_abs_error" in v and k != "train"]
    parts.sort(key=lambda k: (not k.startswith("fresh"), k))
    return [
        [name, k.replace("_", " "), str(report[k]["count"])]
        + [tb.fmt(report[k][m], ".1%") for m in ("median_abs_error", "p90_abs_error", "max_abs_error")]
        for k in parts
    ]


def _run_line(name: str, run: dict) -> str:
    report = run["report"]
    splits, fresh, machine = report["splits"], report["fresh"], report["machine"]
    verdict = "met" if fresh.get("meets_targets") else "missed"
    return (
        f"- {name} ({run['busy_loops']} busy loops, {run.get('threads', 1)} thread(s) per rank; load average "
        f"{tb.fmt(run['load_at_start'][0], '.1f')} at the "
        f"start, {tb.fmt(report['fresh_machine']['loadavg_before'][0], '.1f')} before the fresh micro-batches, "
        f"{tb.fmt(report['fresh_machine']['loadavg_after'][0], '.1f')} at the end; {machine['cores']} cores): fresh "
        f"micro-batches timed after the fit {tb.fmt(fresh['median_abs_error'], '.1%')} median, "
        f"{tb.fmt(fresh['p90_abs_error'], '.1%')} p90 (target 10% / 20% {verdict}); held out over "
        f"{splits['count']} splits {tb.fmt(splits['median_abs_error'], '.1%')} median (median over splits), "
        f"{tb.fmt(splits['worst_p90_abs_error'], '.1%')} worst-split p90 (target 5% / 10%). Clock "
        f"{report['clock']}, {tb.fmt(report['runs_per_micro_batch'], '.1f')} runs per micro-batch, the command "
        f"took {tb.fmt(run['seconds'], '.0f')} s."
    )


def table_calibration(runs: dict | None = None) -> str:
    """Each run's errors by micro-batch set, and a line per run with its load, splits, clock and time."""
    runs = _runs() if runs is None else runs
    rows = [row for name, run in runs.items() for row in _part_rows(name, run["report"])]
    header = ["run", "micro-batches", "count", "median abs error", "p90 abs error", "max abs error"]
    lines = [_run_line(name, run) for name, run in runs.items()]
    return tb.markdown(header, rows) + "\n\n" + "\n".join(lines)


def table_ablation(runs: dict | None = None) -> str:
    """The ablation: each re-fit of the runs' own timings, its fresh errors per run (the runs' clocks are named in
    the lines under the calibration table)."""
    runs = _runs() if runs is None else runs
    names = list(runs)
    header = ["clock", "micro-batch time", "loss", "fit set"]
    header += [f"{n}: fresh {what}" for n in names for what in ("median", "p90")]
    rows = []
    for i, v in enumerate(runs[names[0]]["ablation"]):
        row = [f"{v['clock_role']} clock", v["statistic"], v["loss"], v["fit_set"]]
        for n in names:
            w = runs[n]["ablation"][i]
            row += [tb.fmt(w["fresh"]["median_abs_error"], ".1%"), tb.fmt(w["fresh"]["p90_abs_error"], ".1%")]
        rows.append(row)
    return tb.markdown(header, rows)


TABLES = {  # docs/ marker name -> the table, from the record
    "calibration": table_calibration,
    "calibration_ablation": table_ablation,
}


if __name__ == "__main__":
    main()
