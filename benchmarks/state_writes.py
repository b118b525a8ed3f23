"""What recording a pretokenize run's progress costs per shard, at 100 and 1,000 shards.

A fresh child process pretokenizes a synthetic corpus (the byte tokenizer, one small document after another) into
exactly N shards and times every call that records progress (`pipeline.atomic_write_json` of the run state, and the
state journal's `append` where the tree has one): process CPU and wall clock, summed, divided by the shards. The
shard files themselves are not in the figure. The folder is on `--dir` (default /dev/shm, a tmpfs: fsync costs
nothing there, so the figures are the recording's own work, which grows with the shards, not the disk's latency,
which does not). `--before DIR` runs the same child on another source
tree (e.g. `git archive <commit> | tar -x -C DIR`) in paired alternating repetitions. Writes
benchmarks/results/state_writes.json.
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

DOC_WORDS = 30  # ~180 byte tokens per document
DOCS_PER_SHARD = 4


def child(shards: int, where: str) -> dict:
    """Runs in a fresh process (the tree on PYTHONPATH): one pretokenize run of `shards` shards, its recording timed."""
    from balancer.data.pretokenize import pipeline
    from balancer.data.pretokenize.options import PretokenizeOptions

    spent = {"cpu": 0.0, "wall": 0.0, "calls": 0}

    def timed(fn):
        def run(*a, **k):
            c, w = time.process_time(), time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent["cpu"] += time.process_time() - c
                spent["wall"] += time.perf_counter() - w
                spent["calls"] += 1

        return run

    pipeline.atomic_write_json = timed(pipeline.atomic_write_json)
    journal = getattr(pipeline, "StateJournal", None)
    if journal is not None:
        journal.append = timed(journal.append)
    with tempfile.TemporaryDirectory(dir=where) as tmp:
        src = Path(tmp) / "c.jsonl"
        text = " ".join(["word"] * DOC_WORDS)
        with open(src, "w") as f:
            for i in range(shards * DOCS_PER_SHARD):
                f.write(json.dumps({"text": f"{i} {text}"}) + "\n")
        tokens = len(f"0 {text}".encode()) * DOCS_PER_SHARD
        opts = PretokenizeOptions(shard_tokens=tokens - 10)
        t0 = time.perf_counter()
        manifest = pipeline.pretokenize([str(src)], Path(tmp) / "tok", options=opts, progress=False)
        total = time.perf_counter() - t0
    made = len(manifest["shards"])
    return {
        "shards": made,
        "record_calls": spent["calls"],
        "record_cpu_ms_per_shard": round(1000 * spent["cpu"] / made, 4),
        "record_wall_ms_per_shard": round(1000 * spent["wall"] / made, 4),
        "run_wall_seconds": round(total, 2),
    }


def run_child(tree: str, shards: int, where: str) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(shards), "--dir", where]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=tree)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shards", type=int, nargs="+", default=[100, 1000], help="shard counts to run")
    ap.add_argument("--repeats", type=int, default=2, help="paired repetitions")
    ap.add_argument("--before", help="another source tree to run the same child on (alternating)")
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None, help="where the folders go")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.dir)))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import table, write_result

    here = str(Path(__file__).resolve().parent.parent)
    trees = {"after": here} | ({"before": str(Path(args.before).resolve())} if args.before else {})
    runs = {name: {n: [] for n in args.shards} for name in trees}
    for r in range(args.repeats):
        for n in args.shards:
            for name in list(trees) if r % 2 == 0 else list(trees)[::-1]:
                res = run_child(trees[name], n, args.dir)
                runs[name][n].append(res)
                print(name, n, res, flush=True)
    median = {
        name: {
            n: {k: sorted(r[k] for r in rs)[len(rs) // 2] for k in rs[0] if k.startswith("record_") and "ms" in k}
            for n, rs in per.items()
        }
        for name, per in runs.items()
    }
    labels = {"after": "this tree", "before": args.before or ""}
    rows = [
        [labels[name], f"{n:,}", f"{m['record_cpu_ms_per_shard']:.3f} ms", f"{m['record_wall_ms_per_shard']:.3f} ms",
         str(runs[name][n][0]["record_calls"])]
        for name, per in median.items() for n, m in per.items()
    ]  # fmt: skip
    columns = ["code", "shards", "recording CPU per shard", "recording wall per shard", "recording calls"]
    result = {"dir": args.dir, "runs": runs, "median": median, "tables": {"per_shard": table(columns, rows)}}
    print("median:", median)
    print("wrote", write_result("state_writes", result, clock="process_cpu"))


if __name__ == "__main__":
    main()
