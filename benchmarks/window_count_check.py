"""What does the fragmentation check cost `len(sampler)` and the windowed epoch? `window_step_counts` (what the
sampler's len() adds up) and the planning of a few windows, with the working tree's `balancer` against commit REF's.

`python benchmarks/window_count_check.py --against REF [--only PATH ...] [--reps N]` checks REF out into a temporary
`git worktree` (with `--only`, the "here" side is HEAD plus the working tree's version of those paths, so other
uncommitted edits stay out), then times every shape once per side per repetition in fresh subprocesses, the order of
the sides alternating. Clock: process CPU time. Shapes: 1M SFT-like documents (log-normal, median 700) on dp4 x cp2 x
M4 x 2,048 with the default window and with windows of 4,096 documents; 200K documents of 10-400 tokens on dp2 x M2 x
512 (micro-batches the documents fragment) with windows of 40 documents, whose counts the check raises. Also
reported: how many windows' counts differ between the sides. Writes benchmarks/results/window_count_check.json (or
`--name`)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from _common import git_commit, table, write_result
from plan_guard import add_worktree, here_from_head, remove_worktree

SHAPES = {
    "sft_1m_default": {"data": "sft", "topo": dict(dp=4, cp=2, micro_batches=4, max_tokens=2048), "window": None},
    "sft_1m_w4096": {"data": "sft", "topo": dict(dp=4, cp=2, micro_batches=4, max_tokens=2048), "window": 4096},
    "near_mb_200k_w40": {"data": "near", "topo": dict(dp=2, micro_batches=2, max_tokens=512), "window": 40},
}
WORKER = r"""
import json, sys, time
from pathlib import Path
import numpy as np
import balancer
from balancer.planning.window import default_window_docs, window_step_counts, plan_window
root, data, shapes = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
assert root.resolve() in Path(balancer.__file__).resolve().parents, balancer.__file__
out = {}
for name, sh in shapes.items():
    lengths = np.load(data / f"{sh['data']}.npy")
    topo = balancer.Topology(**sh["topo"])
    wd = sh["window"] or default_window_docs(len(lengths), int(lengths.sum()), topo)
    c0 = time.process_time()
    counts = window_step_counts(lengths, topo, seed=0, epoch=1, window_docs=wd)
    c1 = time.process_time()
    for w in range(min(3, len(counts))):
        plan_window(lengths, topo, balancer.CostModel(1.0, 50.0), seed=0, epoch=1, index=w, window_docs=wd)
    c2 = time.process_time()
    out[name] = {"count_cpu": c1 - c0, "plan3_cpu": c2 - c1, "counts": counts.tolist()}
print(json.dumps(out))
"""


def run_side(root: Path, data: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", WORKER, str(root), str(data), json.dumps(SHAPES)], env=env,
                          capture_output=True, text=True, cwd=root)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"window_count_check: the side at {root} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", required=True, help="the commit to compare with")
    ap.add_argument("--only", nargs="+", help="here = HEAD plus the working tree's version of these paths only")
    ap.add_argument("--reps", type=int, default=3, help="paired repetitions (default 3)")
    ap.add_argument("--name", default="window_count_check", help="record name under benchmarks/results/")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="window_count_check_") as tmp:
        parent = Path(tmp)
        np.save(parent / "sft.npy", np.clip(np.random.default_rng(1).lognormal(np.log(700), 0.8, 1_000_000), 32,
                                            4096).astype(np.int64))  # fmt: skip
        np.save(parent / "near.npy", np.random.default_rng(5).integers(10, 400, 200_000))
        sides = {"here": here_from_head(args.only, parent) if args.only else Path(__file__).resolve().parents[1],
                 "ref": add_worktree(args.against, parent)}  # fmt: skip
        try:
            runs: dict = {"here": [], "ref": []}
            for rep in range(args.reps):
                for side in ("here", "ref") if rep % 2 == 0 else ("ref", "here"):
                    runs[side].append(run_side(sides[side], parent))
        finally:
            for path in sides.values():
                if path.is_relative_to(parent):
                    remove_worktree(path)
    rows, shapes = [], {}
    for name in SHAPES:
        ratio = [h[name]["count_cpu"] / r[name]["count_cpu"] for h, r in zip(runs["here"], runs["ref"])]
        plan = [h[name]["plan3_cpu"] / r[name]["plan3_cpu"] for h, r in zip(runs["here"], runs["ref"])]
        here_c, ref_c = np.array(runs["here"][0][name]["counts"]), np.array(runs["ref"][0][name]["counts"])
        shapes[name] = {"count_cpu_here": [h[name]["count_cpu"] for h in runs["here"]],
                        "count_cpu_ref": [r[name]["count_cpu"] for r in runs["ref"]], "count_ratio": ratio,
                        "plan3_ratio": plan, "windows": len(here_c), "windows_raised": int((here_c != ref_c).sum()),
                        "steps_here": int(here_c.sum()), "steps_ref": int(ref_c.sum())}  # fmt: skip
        rows.append([name, str(len(here_c)), f"{np.median(shapes[name]['count_cpu_here']):.3f}",
                     f"{np.median(shapes[name]['count_cpu_ref']):.3f}",
                     f"{np.median(ratio):.2f} ({min(ratio):.2f}-{max(ratio):.2f})",
                     f"{np.median(plan):.2f} ({min(plan):.2f}-{max(plan):.2f})",
                     f"{shapes[name]['windows_raised']} ({ref_c.sum()} -> {here_c.sum()} steps)"])  # fmt: skip
    columns = ["shape", "windows", "len() CPU s here", "len() CPU s at REF", "len() ratio (median, range)",
               "3 windows planned: ratio", "windows whose count rose"]  # fmt: skip
    payload = {"against": args.against, "only": args.only, "reps": args.reps, "shapes": shapes,
               "here_commit": git_commit(), "tables": {"counts": table(columns, rows)}}  # fmt: skip
    path = write_result(args.name, payload, clock="process_cpu")
    print(json.dumps(payload["tables"], indent=1)[:3000])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
