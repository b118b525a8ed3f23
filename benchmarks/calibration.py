"""How well does the calibrated cost model predict a real model's micro-batch time on this machine?

Times forward + backward of a tiny Llama (balancer.calibration.TINY_LLAMA) on SFT-like, long-tail and mixed packed
micro-batches of 2K-8K tokens, on CP 1 and CP 2 (gloo, one thread per rank; zigzag, and the hybrid layout when this
build has it), fits every cost term on 75% of them and reports the error on the held-out rest. Writes
benchmarks/results/calibration.json (report and every sample) and benchmarks/results/cost_tiny_llama_cpu.json (the
fitted model, read by measured_speedup.py).

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

from attention.layout import KINDS as LAYOUT_KINDS
from balancer.calibration import TINY_LLAMA, calibrate
from balancer.cli.calibrate import format_report

COST_FILE = RESULTS / "cost_tiny_llama_cpu.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smaller grid (a test run)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    budgets = (2048, 4096) if args.quick else (2048, 4096, 8192)
    layouts = ("zigzag", "hybrid") if "hybrid" in LAYOUT_KINDS else ("zigzag",)
    t0 = time.perf_counter()
    result = calibrate(
        TINY_LLAMA,
        cp_sizes=(1, 2),
        layouts=layouts,
        budgets=budgets,
        per_cell=2 if args.quick else 4,
        repeats=args.repeats,
        held_out=0.25,
        seed=0,
        progress=sys.stderr.isatty(),
    )
    result.save(COST_FILE)
    print(format_report(result.cost, result.report))
    wall = {"cp1": [], "cp2": []}
    for s in result.samples:  # the same fit judged on wall time: how much other jobs disturb this machine
        wall[f"cp{s['cp']}"].append(min(s["wall"]) / s["seconds"])
    path = write_result(
        "calibration",
        {
            "config": TINY_LLAMA,
            "budgets": list(budgets),
            "layouts": list(layouts),
            "cost_model": result.cost.to_dict(),
            "report": result.report,
            "wall_over_cpu_median": {k: float(sorted(v)[len(v) // 2]) for k, v in wall.items() if v},
            "samples": result.samples,
            "seconds": time.perf_counter() - t0,
            "note": "other jobs shared the 2 CPUs during this run (see loadavg); times are process CPU time, min of "
            "repeats",
        },
        clock="wall",
    )
    print(f"wrote {path} and {COST_FILE}")


if __name__ == "__main__":
    main()
