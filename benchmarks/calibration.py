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


if __name__ == "__main__":
    main()
