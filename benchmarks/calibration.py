"""How well does the calibrated cost model predict a real model's micro-batch time on this machine?

Runs `balancer calibrate` with its default settings (balancer.calibration.run.DEFAULTS: a tiny Llama, CP 1 and CP 2
over gloo with one thread per rank, the zigzag and hybrid layouts, the default token budgets) and records what it
reports: the held-out error of the first split and over several splits by micro-batch (a held-out micro-batch's
documents are never timed in the fit), the error on fresh micro-batches (other documents, other budgets), the clock
and why, the machine's load, and the wall time the calibration took. Writes benchmarks/results/calibration.json
(report and every sample) and benchmarks/results/cost_tiny_llama_cpu.json (the fitted model, read by replay.py).

    python benchmarks/calibration.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's packages, not an installed copy

import _render as tb
from _common import RESULTS, write_result

from balancer.calibration import TINY_LLAMA, calibrate
from balancer.calibration.run import DEFAULTS
from balancer.cli.calibrate import format_report

COST_FILE = RESULTS / "cost_tiny_llama_cpu.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small grid (a test run; results not written)")
    args = ap.parse_args()
    settings = dict(budgets=(1024, 2048), per_cell=2, repeats=1, max_repeats=2, splits=3) if args.quick else {}
    t0 = time.perf_counter()
    result = calibrate(TINY_LLAMA, **settings, progress=sys.stderr.isatty())
    seconds = time.perf_counter() - t0
    print(format_report(result.cost, result.report))
    for warning in result.report["warnings"]:
        print(f"warning: {warning}", file=sys.stderr)
    print(f"calibration took {seconds:.0f} s (wall)")
    if args.quick:
        return
    result.save(COST_FILE)
    path = write_result(
        "calibration",
        {
            "settings": {k: list(v) if isinstance(v, tuple) else v for k, v in DEFAULTS.items()},
            "cost_model": result.cost.to_dict(),
            "report": result.report,
            "samples": result.samples,
            "seconds": seconds,
        },
        clock="wall" if result.report["clock"] == "wall" else "process_cpu",
        model=TINY_LLAMA,
    )
    print(f"wrote {path} and {COST_FILE}")


# ---- the tables this benchmark states (rendered into docs/ by benchmarks/tables.py) ----


def table_calibration() -> str:
    data = tb.load("calibration")
    report = data["report"]
    rows = [
        [
            name.replace("_", " "),
            str(part["count"]),
            tb.fmt(part["median_abs_error"], ".1%"),
            tb.fmt(part["p90_abs_error"], ".1%"),
            tb.fmt(part["max_abs_error"], ".1%"),
        ]
        for name, part in report.items()
        if isinstance(part, dict) and "p90_abs_error" in part and "max_abs_error" in part
    ]
    table = tb.markdown(["micro-batches", "count", "median abs error", "p90 abs error", "max abs error"], rows)
    splits = report.get("splits")
    if not splits or "median_abs_error" not in splits:
        return table
    machine = report.get("machine", {})
    pct = {k: tb.fmt(splits[k], ".1%") for k in splits if k.endswith("abs_error")}
    return (
        f"{table}\n\nHeld out over {splits['count']} splits by micro-batch: median |error| {pct['median_abs_error']} "
        f"(median over splits; worst split {pct['worst_median_abs_error']}), p90 {pct['median_p90_abs_error']} "
        f"(median; worst split {pct['worst_p90_abs_error']}). Targets (median <= 5%, p90 <= 10%) "
        f"{'met' if report.get('meets_targets') else 'missed'}. Clock: {report.get('clock')}, "
        f"{machine.get('cores')} cores, load average {tb.fmt(machine['loadavg_before'][0], '.1f')} before and "
        f"{tb.fmt(machine['loadavg_after'][0], '.1f')} after timing, "
        f"{tb.fmt(report.get('timing_seconds'), '.0f')} s of "
        f"timing, {tb.fmt(report.get('runs_per_micro_batch'), '.1f')} runs per micro-batch on average."
    )


TABLES = {  # docs/ marker name -> the table, from the record
    "calibration": table_calibration,
}


if __name__ == "__main__":
    main()
