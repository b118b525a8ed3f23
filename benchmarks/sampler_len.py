"""`len(sampler)` on a large corpus: its CPU time, and whether it equals the micro-batches the sampler yields.

A fresh child process memory-maps 30M document lengths (the wlbllm trace resampled, int64 .npy, as
benchmarks/window_planning.py), builds a rank's BalancedBatchSampler with the default windows (dp64 x cp4 x M8 x
32,768) and reports the process CPU time of the constructor, of `len(sampler)` and of the first micro-batch.
`--before DIR` runs the same child on another source tree too (e.g. `git archive <commit> | tar -x -C DIR`), in
paired alternating repetitions. `--exact` also plans every window once and checks that the planned steps add up
to `len(sampler) / micro_batches` (minutes). Writes benchmarks/results/sampler_len.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import DEFAULT_COST

import balancer
from balancer.data.traces import load_trace

BIG = dict(dp=64, cp=4, pp=1, micro_batches=8, max_tokens=32768)


def child(path: str, exact: bool) -> dict:
    """Runs in a fresh process (the tree on PYTHONPATH): constructor, len, first micro-batch, each timed."""
    import torch  # noqa: F401 - imported before the measurement, as a training process has it

    lengths = np.load(path, mmap_mode="r")
    topo = balancer.Topology(**BIG)
    t0 = time.process_time()
    sampler = balancer.BalancedBatchSampler(lengths, topo, DEFAULT_COST, dp_rank=17, seed=0)
    t1 = time.process_time()
    n = len(sampler)
    t2 = time.process_time()
    next(iter(sampler))
    t3 = time.process_time()
    out = {
        "windows": sampler.num_windows,
        "len": n,
        "constructor_cpu_seconds": round(t1 - t0, 3),
        "len_cpu_seconds": round(t2 - t1, 3),
        "first_micro_batch_cpu_seconds": round(t3 - t2, 3),
    }
    if exact:  # plan every window once: its steps against the count len() used
        ew = sampler.windows
        planned = [ew.segment(w).num_steps for w in range(ew.count)]
        out["planned_steps"] = int(sum(planned))
        out["len_equals_planned"] = bool(sum(planned) * topo.micro_batches == n)
    return out


def run_child(tree: str, path: str, exact: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    cmd = [sys.executable, str(Path(tree) / "benchmarks" / "sampler_len.py"), "--child", path]
    if exact:
        cmd.append("--exact")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=tree)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=30_000_000, help="documents (the wlbllm trace resampled)")
    ap.add_argument("--repeats", type=int, default=3, help="paired repetitions")
    ap.add_argument("--before", help="another source tree to run the same child on (alternating)")
    ap.add_argument("--exact", action="store_true", help="also plan every window and compare with len (minutes)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.exact)))
        return
    from _common import table, write_result  # the parent's (a --before tree's children need only DEFAULT_COST)

    here = str(Path(__file__).resolve().parent.parent)
    trees = {"after": here} | ({"before": str(Path(args.before).resolve())} if args.before else {})
    runs: dict[str, list] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "lengths.npy")
        np.save(path, load_trace("wlbllm", n=args.docs, seed=0).astype(np.int64))
        for r in range(args.repeats):
            order = list(trees) if r % 2 == 0 else list(trees)[::-1]
            for name in order:
                res = run_child(trees[name], path, exact=False)
                runs[name].append(res)
                print(name, res, flush=True)
        exact = run_child(here, path, exact=True) if args.exact else None
        if exact:
            print("exact:", exact, flush=True)
    summary = {
        name: {k: float(np.median([r[k] for r in rs])) for k in rs[0] if k.endswith("cpu_seconds")}
        for name, rs in runs.items()
    }
    result = {"documents": args.docs, "topology": BIG, "runs": runs, "median": summary, "exact": exact}
    result["goals"] = {"len_cpu<=0.5s": summary["after"]["len_cpu_seconds"] <= 0.5}
    names = {"after": "this tree", "before": args.before or ""}
    rows = [
        [names[name], str(runs[name][0]["windows"]), f"{runs[name][0]['len']:,}",
         f"{m['constructor_cpu_seconds']:.2f} s", f"{m['len_cpu_seconds']:.2f} s",
         f"{m['first_micro_batch_cpu_seconds']:.2f} s"]
        for name, m in summary.items()
    ]  # fmt: skip
    columns = ["code", "windows", "len(sampler)", "constructor CPU", "len() CPU", "first micro-batch CPU"]
    result["tables"] = {"len": table(columns, rows)}
    if exact:
        result["tables"]["exact"] = table(
            ["len(sampler)", "steps planned, every window", "equal"],
            [
                [
                    f"{exact['len']:,}",
                    f"{exact['planned_steps']:,} x {BIG['micro_batches']}",
                    exact["len_equals_planned"],
                ]
            ],
        )
    if exact:
        result["goals"]["len_equals_planned"] = exact["len_equals_planned"]
    print("median:", summary, "goals:", result["goals"])
    print("wrote", write_result("sampler_len", result, clock="process_cpu"))


if __name__ == "__main__":
    main()
