"""Re-measure every figure README.md quotes, then regenerate the docs tables from the new records.

`python benchmarks/readme_figures.py` runs, one after the other, each benchmark behind a README claim with the
command that measures it fresh (no record reused: the peers are re-run beside the project), each writing its record
with its commit, clock and the machine's load at start and end (benchmarks/_common.write_result), then
`benchmarks/tables.py`. `--list` prints the claims and commands without running them; `--only NAME ...` runs those
entries. Hours in all on a 2-core machine (the measured-balance and trainer runs dominate): run it on a quiet one.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# name: (the README claim it backs, the command's arguments after `python`)
FIGURES: dict[str, tuple[str, list[str]]] = {
    "planner_quality": ("planner imbalance on the four traces against a WLB-LLM-style greedy",
                        ["benchmarks/planner_quality.py"]),
    "planner_speed": ("1M-document epochs against the per-document greedy, the sft trace, one global batch",
                      ["benchmarks/planner_speed.py"]),
    "plan_guard": ("the planner against the commit before the fourth wave, the whole `balancer plan sft` commands",
                   ["benchmarks/plan_guard.py", "--against", "6b2c631", "--full"]),
    "balance_batch_speed": ("balance_batch on 16K and 128K GRPO rollouts", ["benchmarks/balance_batch_speed.py"]),
    "compare": ("against TRL BFD, multipack, verl and WLB on the same documents", ["benchmarks/compare.py"]),
    "compare_peers": ("the 2026 built-ins' planners, peers re-run in the same run",
                      ["benchmarks/compare.py", "--suite", "peers2026"]),
    "replay": ("whole epochs measured on 2 replica processes against TRL packing", ["benchmarks/replay.py"]),
    "hybrid_layout": ("the hybrid layout against zigzag at CP 2",
                      ["benchmarks/hybrid_layout.py", "--reps", "3", "--sweep-batches", "few_long"]),
    "calibration": ("the calibrated model's held-out error", ["benchmarks/calibration.py"]),
    "dynamic_cp": ("dynamic CP on a memory-tight heavy-tail pipeline", ["benchmarks/dynamic_cp.py"]),
    "trainer_compare": ("BalancedTrainer against the built-in trainers",
                        ["benchmarks/trainer_compare.py", "--reps", "4"]),
    "measured_balance_interleaved": ("measured balance on uneven and equal ranks",
                                     ["benchmarks/measured_balance.py", "--configs", "uneven,equal", "--windows", "10",
                                      "--interleave", "--pairs", "5", "--output", "measured_balance_interleaved"]),
    "measured_balance_dynamic": ("measured balance with dynamic CP",
                                 ["benchmarks/measured_balance.py", "--configs", "dynamic", "--pairs", "5",
                                  "--output", "measured_balance_dynamic"]),
}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--list", action="store_true", help="print the claims and their commands, run nothing")
    ap.add_argument("--only", nargs="+", metavar="NAME", help=f"run only these entries (of {', '.join(FIGURES)})")
    args = ap.parse_args()
    names = args.only or list(FIGURES)
    unknown = [n for n in names if n not in FIGURES]
    if unknown:
        ap.error(f"--only: unknown {unknown}; known: {list(FIGURES)}")
    for name in names:
        claim, command = FIGURES[name]
        print(f"{name}: {claim}\n    python {' '.join(command)}", flush=True)
        if args.list:
            continue
        started = time.perf_counter()
        done = subprocess.run([sys.executable, *command], cwd=ROOT)
        if done.returncode not in (0, 1):  # 1: a benchmark that ran and reports a missed goal or a failed guard
            print(f"readme_figures: {name} failed (exit {done.returncode})", file=sys.stderr)
            return done.returncode
        print(f"    done in {time.perf_counter() - started:.0f} s (exit {done.returncode})", flush=True)
    if args.list:
        return 0
    return subprocess.run([sys.executable, "benchmarks/tables.py"], cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
