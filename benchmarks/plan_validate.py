"""How long does checking a plan take at a million documents: `Plan.validate` (span coverage, caps, nesting) and
`Plan.load` of the .npz and JSON files with and without it, against the time the plan took to make?

dp64 x cp4, 8 micro-batches, max_tokens 8192 with overflow="split" (long documents become windows), lengths
resampled from the built-in WLB-LLM trace. Process CPU time (the machine is shared), best of `--repeat`.
Writes benchmarks/results/plan_validate.json (the table in docs/plan-format.md).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import _render as tb
from _common import DEFAULT_COST, write_result

import balancer
from balancer.data.traces import load_trace


def cpu_best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--documents", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    topo = balancer.Topology(dp=64, cp=4, micro_batches=8, max_tokens=8192)
    lengths = load_trace("wlbllm", n=args.documents, seed=1)
    t0 = time.process_time()
    plan = balancer.plan(lengths, topo, DEFAULT_COST, seed=0, overflow="split")
    plan_s = time.process_time() - t0
    row = {"documents": args.documents, "placements": len(plan.doc), "steps": plan.num_steps, "plan_s": plan_s}
    row["validate_s"] = cpu_best(plan.validate, args.repeat)
    with tempfile.TemporaryDirectory() as folder:
        for suffix in (".npz", ".json"):
            path = Path(folder) / f"plan{suffix}"
            plan.save(path)
            key = suffix.lstrip(".")
            row[f"load_{key}_s"] = cpu_best(lambda: balancer.Plan.load(path), args.repeat)
            row[f"load_{key}_unvalidated_s"] = cpu_best(lambda: balancer.Plan.load(path, validate=False), args.repeat)
    print(row)
    write_result("plan_validate", {"topology": str(topo), "rows": [row]}, clock="process_cpu")


# ---- the tables this benchmark states (rendered into docs/ by benchmarks/tables.py) ----


def table_plan_validate() -> str:
    data = tb.load("plan_validate")
    rows = [
        [
            f"{r['documents']:,} ({r['placements']:,} placements, {r['steps']:,} steps)",
            tb.fmt(r["plan_s"], ".1f"),
            tb.fmt(r["validate_s"], ".2f"),
            f"{tb.fmt(r['load_npz_s'], '.2f')} ({tb.fmt(r['load_npz_unvalidated_s'], '.2f')})",
            f"{tb.fmt(r['load_json_s'], '.2f')} ({tb.fmt(r['load_json_unvalidated_s'], '.2f')})",
        ]
        for r in data["rows"]
    ]
    load_avg = data["machine"]["load_average_start"][0]
    header = ["documents", "plan (s)", "validate (s)", "load .npz (unvalidated)", "load JSON (unvalidated)"]
    note = (
        f"\n\n{data['topology']}; process CPU seconds, best of the repeats, {data['machine']['cpus']} cores, load "
        f"average {load_avg} at start ({data['date']}, {tb.commit_note(data)})."
    )
    return tb.markdown(header, rows) + note


TABLES = {  # docs/ marker name -> the table, from the record
    "plan_validate": table_plan_validate,
}


if __name__ == "__main__":
    main()
