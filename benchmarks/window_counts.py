"""What fixing every window's step count up front (from its documents and the token budget, never the cost model)
costs in plan quality and planning time: planner-quality rows (traces x the 3 standard topologies, 78K-100K
documents) planned window by window (windows of `--steps` steps' documents, 64 = the default window's size in
steps) on this tree and on `--before DIR` (another source tree, e.g. `git archive <commit> | tar -x -C DIR`), a fresh
process per trace and tree, the trees alternating. Epoch efficiency of the windowed plans (the whole-epoch plan is
the same bit for bit) and the process CPU time of the windowed planning. Writes benchmarks/results/window_counts.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from _common import table, write_result


def child(traces: list[str], seed: int, steps: list[int]) -> dict:
    """Runs in a fresh process (the tree under test on PYTHONPATH): every row's epoch planned window by window for
    windows of each of `steps` steps' documents; efficiency and the process CPU time of that planning."""
    sys.path.insert(0, str(Path(__file__).parent))
    from _common import TOPOLOGIES, standard_topology  # noqa: PLC0415
    from window_planning import docs_per_step, windowed_efficiency  # noqa: PLC0415

    from balancer.data.traces import load_trace  # noqa: PLC0415

    rows, cpu = [], 0.0
    for trace in traces:
        lengths = load_trace(trace, seed=seed)
        for tname, (dp, cp, pp, m) in TOPOLOGIES.items():
            topo = standard_topology(lengths, dp, cp, pp, m)
            row = {"distribution": trace, "topology": tname, "documents": len(lengths)}
            for k in steps:
                window = max(topo.bins_per_step, int(np.ceil(k * docs_per_step(lengths, topo))))
                t0 = time.process_time()
                eff, windows = windowed_efficiency(lengths, topo, window, seed)
                cpu += time.process_time() - t0
                row[f"steps_{k}"] = {"efficiency": eff, "windows": windows}
            rows.append(row)
    return {"rows": rows, "cpu_seconds": round(cpu, 2)}


def run_child(tree: str, traces: list[str], seed: int, steps: list[int]) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    here = Path(__file__).resolve()
    cmd = [sys.executable, str(here), "--child", *traces, "--seed", str(seed), "--steps", *map(str, steps)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=str(here.parent))
    return json.loads(out.stdout.strip().splitlines()[-1])


def quality_table(rows: list[dict], steps: list[int], order: list[str]) -> dict:
    """Epoch efficiency of each row's windowed plans, `before / after` per window size."""
    columns = ["distribution", "topology", *(f"{k} steps ({' / '.join(order)})" for k in steps)]
    cells = [
        [r["distribution"], r["topology"], *(" / ".join(f"{r[f'steps_{k}'][n]:.4f}" for n in order) for k in steps)]
        for r in rows
    ]
    return {"quality": table(columns, cells)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", help="the source tree to compare with")
    ap.add_argument("--traces", nargs="+", default=["wlbllm", "sft", "heavy"])
    ap.add_argument("--steps", nargs="+", type=int, default=[64], help="window sizes, in steps' documents")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.seed, args.steps)))
        return
    here = str(Path(__file__).resolve().parent.parent)
    trees = {"after": here} | ({"before": str(Path(args.before).resolve())} if args.before else {})
    runs: dict[str, list] = {name: [] for name in trees}
    for trace_i, trace in enumerate(args.traces):  # one trace at a time, the trees alternating
        order = list(trees) if trace_i % 2 == 0 else list(trees)[::-1]
        for name in order:
            runs[name].append(run_child(trees[name], [trace], args.seed, args.steps))
    rows_out = []
    for name, parts in runs.items():
        for i, row in enumerate(r for p in parts for r in p["rows"]):
            if len(rows_out) <= i:
                rows_out.append({"distribution": row["distribution"], "topology": row["topology"]})
            for k in args.steps:
                rows_out[i].setdefault(f"steps_{k}", {})[name] = row[f"steps_{k}"]["efficiency"]
    for r in rows_out:
        print(r, flush=True)
    cpu = {name: round(sum(p["cpu_seconds"] for p in parts), 2) for name, parts in runs.items()}
    result = {"rows": rows_out, "steps": args.steps, "cpu_seconds": cpu}
    if "before" in runs:
        diffs = [r[f"steps_{k}"]["after"] - r[f"steps_{k}"]["before"] for r in rows_out for k in args.steps]
        result["efficiency_change"] = {"min": float(np.min(diffs)), "mean": float(np.mean(diffs)),
                                       "max": float(np.max(diffs))}  # fmt: skip
        result["goals"] = {"mean_change>=-0.001": result["efficiency_change"]["mean"] >= -0.001}
        print("change after - before:", result["efficiency_change"], "cpu:", cpu)
    result["tables"] = quality_table(rows_out, args.steps, [n for n in ("before", "after") if n in runs])
    print("wrote", write_result("window_counts", result, clock="process_cpu"))


if __name__ == "__main__":
    main()
